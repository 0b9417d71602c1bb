"""The packages the distribution ships; everything else is configured in pyproject.toml.

Every package under lit_marl/ is found, namespace-style, so a folder of modules without an
``__init__.py`` ships too; the top-level folder callbacks/ ships as ``lit_marl.callbacks``
(pyproject.toml's ``[tool.setuptools.package-dir]`` maps it). pyproject.toml alone cannot say
both: its ``packages`` is a fixed list or one find directive, and a find directive names a package
after its folder, so it never yields ``lit_marl.callbacks`` from callbacks/.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["lit_marl", "lit_marl.*"], exclude=["*.__pycache__"]),
        "lit_marl.callbacks",
    ]
)
