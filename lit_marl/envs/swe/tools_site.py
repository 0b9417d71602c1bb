"""The only installed packages a test run or a ``run`` command sees: pytest and what it requires, copied
once from the trainer's environment into a folder of their own (``$LIT_MARL_CACHE/swe/site-<key>``),
plus the distributions a repository's tests need (``tests.packages``).

The trainer's own site-packages is never shown to the code under test: released versions of the
repositories being fixed may be installed there (more-itertools is, beside pytest), and copying a
released, fixed package over the repository would resolve its instance. The sandbox hides the
interpreters' own package folders as well (``sandbox.installed_package_folders``).
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as metadata
import os
import re
import shutil
import threading
from pathlib import Path

from lit_marl.models import cache_dir

_lock = threading.Lock()
_made: dict[tuple[str, ...], str] = {}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def distributions(wanted: tuple[str, ...]) -> list[metadata.Distribution]:
    """``wanted`` and everything they require (extras left out), as installed beside the trainer."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    todo = list(wanted)
    while todo:
        name = _name(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(
                f"data.env_kwargs.tests.packages: {name!r} is not installed beside the trainer; install it "
                "(pip install NAME) or drop it from the list"
            ) from None
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return [found[name] for name in sorted(found)]


def tools_site(packages: tuple[str, ...] = ()) -> str:
    """The folder (made once per set of versions, atomically) holding pytest, ``packages`` and their
    requirements: the site folder of every sandboxed test run and ``run`` command."""
    wanted = tuple(sorted({"pytest", *packages}))
    with _lock:
        if wanted in _made:
            return _made[wanted]
        dists = distributions(wanted)
        key = hashlib.sha256(" ".join(f"{d.metadata['Name']}=={d.version}" for d in dists).encode()).hexdigest()[:16]
        folder = cache_dir() / "swe" / f"site-{key}"
        if not folder.is_dir():
            _copy(dists, folder)
        _made[wanted] = str(folder)
        return _made[wanted]


def _copy(dists: list[metadata.Distribution], folder: Path) -> None:
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    for dist in dists:
        root = Path(dist.locate_file("")).resolve()
        for path in dist.files or []:
            source = Path(dist.locate_file(path)).resolve()
            if root not in source.parents or "__pycache__" in source.parts or not source.is_file():
                continue  # scripts outside the site folder, bytecode
            target = partial / source.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    compileall.compile_dir(str(partial), quiet=2, workers=1)  # test runs write no bytecode: each would compile pytest
    try:
        partial.rename(folder)
    except OSError:  # another process made it first
        shutil.rmtree(partial, ignore_errors=True)
