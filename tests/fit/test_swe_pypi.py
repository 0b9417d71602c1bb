"""The PyPI SWE set without the network: each mutation operator makes a one-line edit that changes
behaviour, hiding tests and adding them back through ``test_patch`` gives the file back byte for
byte, problem statements tell the symptom and not the expected values, and a tiny local sdist goes
through the same build as the real projects, its instances checked again through the scorer."""

from __future__ import annotations

import difflib
import io
import json
import tarfile
from pathlib import Path

import pytest

from lit_marl import ConfigError
from lit_marl.envs.swe import instances, scoring
from lit_marl.envs.swe.pypi_mutations import (
    OPERATORS,
    make_patch,
    mutations,
    problem_statement,
    remove_tests,
    symptom,
)
from lit_marl.envs.swe.pypi_set import BuildSettings, build_set, layout, read_sdist
from lit_marl.models import cache_dir

SOURCES = {
    "compare": ("def f(x):\n    return x < 3\n", [3]),
    "boolean": ("def f(x):\n    return x > 0 and x < 10\n", [20]),
    "drop_not": ("def f(x):\n    return not x\n", [True]),
    "negate_if": ("def f(x):\n    if x > 0:\n        return 1\n    return 0\n", [1]),
    "arithmetic": ("def f(x):\n    total = x * 2\n    total += 1\n    return total\n", [3]),
    "off_by_one": ("def f(x):\n    return x[1]\n", ["abc"]),
    "bound": ("def f(x):\n    n = len(x) - 1\n    return x[:n], list(range(n))\n", ["abcd"]),
    "drop_statement": ("def f(x):\n    out = []\n    out.append(x)\n    return out\n", [1]),
    "swap_args": ("def f(x):\n    return divmod(x, 3)\n", [7]),
    "true_false": ("def f(x):\n    return sorted(x, reverse=True)\n", [[1, 2]]),
    "swap_call": ("class C:\n    def f(self, x):\n        return max(x), x.startswith('a')\n", [("ab",)]),
}


def _outcomes(source: str, inputs: list) -> list:
    space: dict = {}
    exec(compile(source, "<mutant>", "exec"), space)
    f = space["f"] if "f" in space else space["C"]().f
    results = []
    for x in inputs:
        try:
            results.append(repr(f(*x) if isinstance(x, tuple) else f(x)))
        except Exception as err:  # a mutant that raises fails too
            results.append(type(err).__name__)
    return results


def test_there_is_a_source_for_every_operator():
    assert set(SOURCES) == set(OPERATORS)


@pytest.mark.parametrize("operator", sorted(SOURCES))
def test_each_operator_makes_one_line_edits_that_change_behaviour(operator):
    source, inputs = SOURCES[operator]
    found = mutations(source, "m.py", [operator])
    assert found, f"{operator} proposes nothing for {source!r}"
    for mutation in found:
        assert mutation.operator == operator and mutation.function in ("f", "C.f")
        mutated = mutation.apply(source)
        edits = difflib.SequenceMatcher(None, source.splitlines(), mutated.splitlines()).get_opcodes()
        edits = [(old_end - old_start, new_end - new_start) for kind, old_start, old_end, new_start, new_end in edits
                 if kind != "equal"]  # fmt: skip
        assert edits in ([(1, 1)], [(1, 0)]), f"{mutation} is not one line's edit"
        assert _outcomes(mutated, inputs) != _outcomes(source, inputs), f"{mutation} changes nothing"
        gold = make_patch({"m.py": mutated}, {"m.py": source}, "patch")
        assert instances.apply_patch({"m.py": mutated.encode()}, gold, "patch")["m.py"] == source.encode()


def test_mutations_skip_f_strings_docstrings_and_module_level_code():
    source = 'LIMIT = 3\n\n\ndef f(x):\n    """Twice 2."""\n    return f"{x + 1}"\n'
    assert mutations(source, "m.py") == []


TESTS = """import pytest


def test_plain():
    assert 1


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    assert x


class TestTwo:
    def test_kept(self):
        assert 1

    @pytest.mark.skipif(False, reason="")
    def test_gone(self):
        assert 1


class TestOne:
    def test_only(self):
        assert 1


def test_last():
    assert 1
"""


def test_hiding_tests_and_adding_them_back_gives_the_file_back():
    names = ["test_param", "TestTwo::test_gone", "TestOne::test_only", "test_last"]
    hidden = remove_tests(TESTS, names)
    assert "def test_param" not in hidden and "test_gone" not in hidden and "skipif" not in hidden
    assert "class TestOne" not in hidden and "def test_last" not in hidden
    assert "def test_plain" in hidden and "def test_kept" in hidden and "@pytest.mark.parametrize" not in hidden
    test_patch = make_patch({"tests/test_x.py": hidden}, {"tests/test_x.py": TESTS}, "test_patch")
    restored = instances.apply_patch({"tests/test_x.py": hidden.encode()}, test_patch, "test_patch")
    assert restored["tests/test_x.py"] == TESTS.encode()
    with pytest.raises(ValueError, match="no test"):
        remove_tests(TESTS, ["TestTwo::test_inherited"])


def test_problem_statements_tell_the_symptom_not_the_expected_values():
    assert symptom("assert 41 == 42") == "gives wrong results"
    assert symptom("AssertionError: 41 != 42") == "gives wrong results"
    assert symptom("Failed: DID NOT RAISE <class 'ValueError'>").startswith("no longer raises `ValueError`")
    assert symptom("TypeError: unsupported operand type(s)") == "raises `TypeError`"
    assert (
        symptom("Failed: DID NOT WARN. No warnings of type (<class 'UserWarning'>,)")
        == "no longer warns where it should"
    )
    assert symptom("Failed: expected 'x'") == "gives wrong results"
    messages = {"tests/test_a.py::test_answer_is_right": "assert 41 == 42"}
    text = problem_statement("proj", "1.0", ["`proj.answer()`"], messages)
    assert "`proj.answer()`" in text and "wrong results" in text and "answer is right" in text
    assert "42" not in text and "41" not in text
    assert text == problem_statement("proj", "1.0", ["`proj.answer()`"], messages)


CORE = '''def clamp(x, low, high):
    """Limit x to the range from low to high."""
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values):
    """The arithmetic mean of a non-empty list."""
    if not values:
        raise ValueError("mean of nothing")
    return sum(values) / len(values)


def words(text):
    """The words of a text, lower-cased."""
    return [w.lower() for w in text.split()]
'''
SUITE = """import pytest

from minicalc import clamp, mean, words


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-1, 0, 10) == 0


def test_clamp_high():
    assert clamp(11, 0, 10) == 10


@pytest.mark.parametrize("values, expected", [([1, 2, 3], 2), ([4], 4)])
def test_mean(values, expected):
    assert mean(values) == expected


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


class TestWords:
    def test_split(self):
        assert words("a b") == ["a", "b"]

    def test_lower(self):
        assert words("A b") == ["a", "b"]
"""


def _fake_sdist(folder: Path) -> Path:
    files = {
        "PKG-INFO": "Name: minicalc\n",
        "README.md": "minicalc\n",
        "setup.py": "from setuptools import setup\nsetup()\n",
        "docs/index.md": "# minicalc\n",
        "src/minicalc/__init__.py": "from minicalc.core import clamp, mean, words\n",
        "src/minicalc/core.py": CORE,
        "tests/test_core.py": SUITE,
    }
    path = folder / "minicalc-0.1.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"minicalc-0.1/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_local_sdist_becomes_validated_instances_and_a_source(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="make_swe_pypi.py"):
        instances.resolve_source("swe:pypi:train")
    sdist = _fake_sdist(tmp_path)
    assert sorted(layout(read_sdist(sdist))) == ["README.md", "minicalc/__init__.py", "minicalc/core.py",
                                                 "tests/test_core.py"]  # fmt: skip
    out = cache_dir() / "swe" / "pypi"
    settings = BuildSettings(max_tried=8, max_kept=3, doubles=1, max_p2p=4)
    manifest = build_set(out, {"minicalc": "0.1"}, {"train": ["minicalc"], "test": []}, settings, {"minicalc": sdist})
    record = manifest["projects"]["minicalc"]
    assert record["tests"] == 8 and record["validated"] >= 2 and manifest["validation_rate"] == 1.0
    assert manifest["counts"] == {"train": record["validated"], "test": 0, "all": record["validated"]}
    path = instances.resolve_source("swe:pypi:train")
    rows = [instances.normalize(json.loads(line), "row") for line in open(path)]
    root = tmp_path / "ws"
    for row in rows:
        assert row["task_type"] == "train" and 1 <= len(row["FAIL_TO_PASS"]) <= 10
        base = instances.snapshot(row, None)
        files = {p: d for p, (d, _) in base.items()}
        for test in row["FAIL_TO_PASS"]:  # hidden in the episode, back through test_patch
            name = test.split("[", 1)[0].rsplit("::", 1)[-1]
            assert f"def {name}(" not in files["tests/test_core.py"].decode()
        restored = instances.apply_patch(files, row["test_patch"], "test_patch")
        assert restored["tests/test_core.py"] == SUITE.encode()
        assert instances.apply_patch(files, row["patch"], "patch")["minicalc/core.py"] == CORE.encode()
        before = scoring.score(row, base, files, root, scoring.TestSettings())
        assert all(before.outcomes[t] == "failed" for t in row["FAIL_TO_PASS"])
        assert all(before.outcomes[t] == "passed" for t in row["PASS_TO_PASS"])
        after = scoring.score(
            row, base, instances.apply_patch(files, row["patch"], "patch"), root, scoring.TestSettings()
        )
        assert after.resolved
    first = [json.loads(line) for line in open(instances.resolve_source("swe:pypi:train:1"))]
    assert [r["instance_id"] for r in first] == [min(r["instance_id"] for r in rows)]  # one per project
    for bad in ("swe:pypi:train:x", "swe:pypi:dev", "swe:pypi:train:1:2", "swe:pypi:train:"):
        with pytest.raises(ConfigError, match="instances per project"):
            instances.resolve_source(bad)
    written = Path(path).read_text()
    again = build_set(out, {"minicalc": "0.1"}, {"train": ["minicalc"], "test": []}, settings, {"minicalc": sdist})
    assert again["projects"] == manifest["projects"] and Path(path).read_text() == written  # reused
    (out / "projects" / "minicalc.json").unlink()  # as after a build killed half-way: built again, the same
    build_set(out, {"minicalc": "0.1"}, {"train": ["minicalc"], "test": []}, settings, {"minicalc": sdist})
    assert Path(path).read_text() == written
