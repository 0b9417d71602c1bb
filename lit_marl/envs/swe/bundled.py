"""The bundled SWE instances: six small Python repositories, each with a bug, a problem statement,
failing and passing tests and the known fix, written as git repositories by ``write`` (fixed
authors and dates, so every machine gets the same commits) and listed in SWE-Gym's schema.

Two need more than one hunk (``intervals``: two in one file; ``shop``: two files). ``train`` holds
four repositories, ``test`` the other two (held out). As in SWE-Gym, the FAIL_TO_PASS tests are not
in the repository: they arrive with the instance's ``test_patch`` when the changes are scored, so an
episode sees only the problem statement and the PASS_TO_PASS tests.
"""

from __future__ import annotations

import ast
import difflib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

SPLITS = {"train": ["textkit", "intervals", "shop", "lru"], "test": ["csvlite", "units"]}

REPOS: dict[str, dict] = {
    "textkit": {
        "problem": "slugify() keeps runs of separators: slugify('Hello,  World!') gives 'hello---world-' "
        "instead of 'hello-world'. Runs of non-alphanumeric characters must become one dash, and the slug "
        "must not start or end with a dash.",
        "files": {
            "textkit/__init__.py": "from textkit.slug import slugify\n",
            "textkit/slug.py": (
                "def slugify(text):\n"
                '    """Lower-case words joined by single dashes."""\n'
                "    out = []\n"
                "    for ch in text.lower():\n"
                "        out.append(ch if ch.isalnum() else '-')\n"
                "    return ''.join(out)\n"
            ),
            "tests/test_slug.py": (
                "from textkit import slugify\n\n\n"
                "def test_simple():\n    assert slugify('abc') == 'abc'\n\n\n"
                "def test_lower():\n    assert slugify('ABC') == 'abc'\n\n\n"
                "def test_collapses_runs():\n    assert slugify('Hello,  World!') == 'hello-world'\n\n\n"
                "def test_strips_ends():\n    assert slugify('--a b--') == 'a-b'\n"
            ),
        },
        "fixed": {
            "textkit/slug.py": (
                "def slugify(text):\n"
                '    """Lower-case words joined by single dashes."""\n'
                "    out = []\n"
                "    for ch in text.lower():\n"
                "        out.append(ch if ch.isalnum() else '-')\n"
                "    return '-'.join(part for part in ''.join(out).split('-') if part)\n"
            ),
        },
        "fail": ["tests/test_slug.py::test_collapses_runs", "tests/test_slug.py::test_strips_ends"],
        "pass": ["tests/test_slug.py::test_simple", "tests/test_slug.py::test_lower"],
    },
    "intervals": {
        "problem": "merge() must merge overlapping and touching intervals given in any order: "
        "merge([(5, 6), (1, 3), (3, 4)]) should be [(1, 4), (5, 6)]. Today it only merges strictly "
        "overlapping neighbours of an already sorted list.",
        "files": {
            "intervals.py": (
                "def merge(spans):\n"
                '    """Merge overlapping or touching (start, end) spans."""\n'
                "    result = []\n"
                "    for start, end in spans:\n"
                "        if result and start < result[-1][1]:\n"
                "            result[-1] = (result[-1][0], max(result[-1][1], end))\n"
                "        else:\n"
                "            result.append((start, end))\n"
                "    return result\n"
            ),
            "tests/test_intervals.py": (
                "from intervals import merge\n\n\n"
                "def test_empty():\n    assert merge([]) == []\n\n\n"
                "def test_overlap():\n    assert merge([(1, 5), (2, 6)]) == [(1, 6)]\n\n\n"
                "def test_touching():\n    assert merge([(1, 3), (3, 4)]) == [(1, 4)]\n\n\n"
                "def test_unsorted():\n    assert merge([(5, 6), (1, 3), (3, 4)]) == [(1, 4), (5, 6)]\n"
            ),
        },
        "fixed": {
            "intervals.py": (
                "def merge(spans):\n"
                '    """Merge overlapping or touching (start, end) spans."""\n'
                "    result = []\n"
                "    for start, end in sorted(spans):\n"
                "        if result and start <= result[-1][1]:\n"
                "            result[-1] = (result[-1][0], max(result[-1][1], end))\n"
                "        else:\n"
                "            result.append((start, end))\n"
                "    return result\n"
            ),
        },
        "fail": ["tests/test_intervals.py::test_touching", "tests/test_intervals.py::test_unsorted"],
        "pass": ["tests/test_intervals.py::test_empty", "tests/test_intervals.py::test_overlap"],
    },
    "shop": {
        "problem": "discounted() must round half up to a cent: discounted(999, 50) gives 499, but 499.5 "
        "rounds up to 500. And receipt(850) prints '$8.5' instead of '$8.50' (always two decimals).",
        "files": {
            "shop/__init__.py": "",
            "shop/pricing.py": (
                "def discounted(cents, percent):\n"
                '    """The price after a percent discount, rounded half up to a cent."""\n'
                "    return cents * (100 - percent) // 100\n"
            ),
            "shop/receipt.py": (
                "from shop.pricing import discounted\n\n\n"
                "def receipt(cents, percent=0):\n"
                '    """The price as dollars with two decimals."""\n'
                "    price = discounted(cents, percent)\n"
                "    return f'${price / 100}'\n"
            ),
            "tests/test_shop.py": (
                "from shop.pricing import discounted\nfrom shop.receipt import receipt\n\n\n"
                "def test_no_discount():\n    assert discounted(1000, 0) == 1000\n\n\n"
                "def test_half_up():\n    assert discounted(999, 50) == 500\n\n\n"
                "def test_receipt_whole():\n    assert receipt(1200) == '$12.0' or receipt(1200) == '$12.00'\n\n\n"
                "def test_receipt_cents():\n    assert receipt(850) == '$8.50'\n"
            ),
        },
        "fixed": {
            "shop/pricing.py": (
                "def discounted(cents, percent):\n"
                '    """The price after a percent discount, rounded half up to a cent."""\n'
                "    return (cents * (100 - percent) + 50) // 100\n"
            ),
            "shop/receipt.py": (
                "from shop.pricing import discounted\n\n\n"
                "def receipt(cents, percent=0):\n"
                '    """The price as dollars with two decimals."""\n'
                "    price = discounted(cents, percent)\n"
                "    return f'${price / 100:.2f}'\n"
            ),
        },
        "fail": ["tests/test_shop.py::test_half_up", "tests/test_shop.py::test_receipt_cents"],
        "pass": ["tests/test_shop.py::test_no_discount", "tests/test_shop.py::test_receipt_whole"],
    },
    "lru": {
        "problem": "LRUCache.get() does not count as a use: after put(a), put(b), get(a), put(c) with "
        "capacity 2 the cache evicts 'a' instead of 'b'.",
        "files": {
            "lru.py": (
                "from collections import OrderedDict\n\n\n"
                "class LRUCache:\n"
                "    def __init__(self, capacity):\n"
                "        self.capacity = capacity\n"
                "        self.items = OrderedDict()\n\n"
                "    def get(self, key, default=None):\n"
                "        if key not in self.items:\n"
                "            return default\n"
                "        return self.items[key]\n\n"
                "    def put(self, key, value):\n"
                "        self.items[key] = value\n"
                "        self.items.move_to_end(key)\n"
                "        if len(self.items) > self.capacity:\n"
                "            self.items.popitem(last=False)\n"
            ),
            "tests/test_lru.py": (
                "from lru import LRUCache\n\n\n"
                "def test_put_get():\n    c = LRUCache(2)\n    c.put('a', 1)\n    assert c.get('a') == 1\n\n\n"
                "def test_evicts_oldest():\n    c = LRUCache(1)\n    c.put('a', 1)\n    c.put('b', 2)\n"
                "    assert c.get('a') is None\n\n\n"
                "def test_get_is_a_use():\n    c = LRUCache(2)\n    c.put('a', 1)\n    c.put('b', 2)\n"
                "    c.get('a')\n    c.put('c', 3)\n    assert c.get('a') == 1 and c.get('b') is None\n"
            ),
        },
        "fixed": {
            "lru.py": (
                "from collections import OrderedDict\n\n\n"
                "class LRUCache:\n"
                "    def __init__(self, capacity):\n"
                "        self.capacity = capacity\n"
                "        self.items = OrderedDict()\n\n"
                "    def get(self, key, default=None):\n"
                "        if key not in self.items:\n"
                "            return default\n"
                "        self.items.move_to_end(key)\n"
                "        return self.items[key]\n\n"
                "    def put(self, key, value):\n"
                "        self.items[key] = value\n"
                "        self.items.move_to_end(key)\n"
                "        if len(self.items) > self.capacity:\n"
                "            self.items.popitem(last=False)\n"
            ),
        },
        "fail": ["tests/test_lru.py::test_get_is_a_use"],
        "pass": ["tests/test_lru.py::test_put_get", "tests/test_lru.py::test_evicts_oldest"],
    },
    "csvlite": {
        "problem": "split_row() breaks quoted fields at their commas: split_row('a,\"b,c\",d') must give "
        "['a', 'b,c', 'd'].",
        "files": {
            "csvlite.py": (
                "def split_row(line):\n"
                '    """The fields of one CSV line; a field in double quotes may hold commas."""\n'
                "    return line.split(',')\n"
            ),
            "tests/test_csvlite.py": (
                "from csvlite import split_row\n\n\n"
                "def test_plain():\n    assert split_row('a,b') == ['a', 'b']\n\n\n"
                "def test_empty_field():\n    assert split_row('a,,b') == ['a', '', 'b']\n\n\n"
                "def test_quoted_comma():\n    assert split_row('a,\"b,c\",d') == ['a', 'b,c', 'd']\n"
            ),
        },
        "fixed": {
            "csvlite.py": (
                "def split_row(line):\n"
                '    """The fields of one CSV line; a field in double quotes may hold commas."""\n'
                "    fields, field, quoted = [], '', False\n"
                "    for ch in line:\n"
                "        if ch == '\"':\n"
                "            quoted = not quoted\n"
                "        elif ch == ',' and not quoted:\n"
                "            fields.append(field)\n"
                "            field = ''\n"
                "        else:\n"
                "            field += ch\n"
                "    return fields + [field]\n"
            ),
        },
        "fail": ["tests/test_csvlite.py::test_quoted_comma"],
        "pass": ["tests/test_csvlite.py::test_plain", "tests/test_csvlite.py::test_empty_field"],
    },
    "units": {
        "problem": "to_meters('3 km') returns 3 instead of 3000, and to_meters('12 cm') raises KeyError: "
        "kilometres and centimetres must convert like metres.",
        "files": {
            "units.py": (
                "FACTORS = {'m': 1}\n\n\n"
                "def to_meters(text):\n"
                '    """A length such as \'3 km\' in metres."""\n'
                "    value, unit = text.split()\n"
                "    return float(value) * FACTORS[unit]\n"
            ),
            "tests/test_units.py": (
                "from units import to_meters\n\n\n"
                "def test_meters():\n    assert to_meters('2 m') == 2\n\n\n"
                "def test_km():\n    assert to_meters('3 km') == 3000\n\n\n"
                "def test_cm():\n    assert to_meters('12 cm') == 0.12\n"
            ),
        },
        "fixed": {
            "units.py": (
                "FACTORS = {'m': 1, 'km': 1000, 'cm': 0.01}\n\n\n"
                "def to_meters(text):\n"
                '    """A length such as \'3 km\' in metres."""\n'
                "    value, unit = text.split()\n"
                "    return float(value) * FACTORS[unit]\n"
            ),
        },
        "fail": ["tests/test_units.py::test_km", "tests/test_units.py::test_cm"],
        "pass": ["tests/test_units.py::test_meters"],
    },
}

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "lit_marl",
    "GIT_AUTHOR_EMAIL": "lit_marl@localhost",
    "GIT_COMMITTER_NAME": "lit_marl",
    "GIT_COMMITTER_EMAIL": "lit_marl@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1",
    "HOME": "/nonexistent",
}


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A git-style patch (``a/``, ``b/`` prefixes) from each changed file's old to new text."""
    out = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path, ""), after.get(path, "")
        if old == new:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        out += difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"a/{path}" if path in before else "/dev/null",
            f"b/{path}" if path in after else "/dev/null",
        )
    return "".join(out)


def drop_tests(text: str, names: set[str]) -> str:
    """``text`` (a test module) without its top-level test functions named in ``names`` (decorators
    and the blank lines after each included)."""
    lines = text.splitlines(keepends=True)
    doomed: set[int] = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            end = node.end_lineno
            while end < len(lines) and not lines[end].strip():
                end += 1
            doomed.update(range(start, end))
    kept = "".join(line for i, line in enumerate(lines) if i not in doomed)
    return kept.rstrip("\n") + "\n"


def split_tests(spec: dict) -> tuple[dict[str, str], str]:
    """The repository's files without the FAIL_TO_PASS tests, and the ``test_patch`` adding them."""
    hidden: dict[str, set[str]] = {}
    for test in spec["fail"]:
        path, name = test.split("::", 1)
        hidden.setdefault(path, set()).add(name)
    files = {path: drop_tests(text, hidden[path]) if path in hidden else text for path, text in spec["files"].items()}
    return files, unified_diff({p: files[p] for p in hidden}, {p: spec["files"][p] for p in hidden})


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True).stdout


def write_repo(name: str, folder: Path) -> str:
    """``folder`` as a git repository holding repository ``name``'s buggy version; its commit. A folder
    written from other files (an older version of this module, a write killed half-way) is rewritten."""
    files = split_tests(REPOS[name])[0]
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:12]
    subject = f"{name}: the version with the bug ({digest})"
    if (folder / ".git").is_dir():
        try:
            if _git(folder, "log", "-1", "--format=%s").strip() == subject:
                return _git(folder, "rev-parse", "HEAD").strip()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _git(folder, "init", "-q", "-b", "main")
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    _git(folder, "add", "-A")
    _git(folder, "commit", "-q", "-m", subject)
    return _git(folder, "rev-parse", "HEAD").strip()


def instance(name: str, folder: Path, commit: str) -> dict:
    spec = REPOS[name]
    before = {path: spec["files"][path] for path in spec["fixed"]}
    return {
        "instance_id": f"lit-marl__{name}-1",
        "repo": f"lit-marl/{name}",
        "repo_path": str(folder),
        "base_commit": commit,
        "problem_statement": spec["problem"],
        "FAIL_TO_PASS": spec["fail"],
        "PASS_TO_PASS": spec["pass"],
        "patch": unified_diff(before, spec["fixed"]),
        "test_patch": split_tests(spec)[1],
        "test_cmd": "pytest",
        "task_type": next(split for split, names in SPLITS.items() if name in names),  # evaluation: won/<split>
    }


def write(out_dir: str | Path) -> dict[str, Path]:
    """The repositories under ``out_dir/repos`` and one instance file per split
    (``out_dir/<split>.jsonl``, and ``all.jsonl``); the files of each split. Idempotent."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:  # processes writing the same folder (test workers, ranks) take turns
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _write(out)


def _write(out: Path) -> dict[str, Path]:
    rows = {}
    for name in REPOS:
        folder = out / "repos" / name
        rows[name] = instance(name, folder.resolve(), write_repo(name, folder))
    files = {}
    for split, names in {**SPLITS, "all": list(REPOS)}.items():
        path = out / f"{split}.jsonl"
        text = "".join(json.dumps(rows[n]) + "\n" for n in names)
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        files[split] = path
    return files
