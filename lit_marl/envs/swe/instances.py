"""SWE-Gym instances: loading them (through ``datasets``, from a local file), finding each one's
repository on disk and reading its files at ``base_commit``, and unified diffs (the gold ``patch``
as edits, ``test_patch`` applied before scoring).

An instance row holds SWE-Gym's fields: ``instance_id``, ``repo`` (``owner/name``), ``base_commit``,
``problem_statement``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (pytest node ids: a list, or the JSON
text of one as SWE-Gym's files store them), and optionally ``patch`` (the known fix), ``test_patch``
(tests added before scoring), ``test_cmd`` (``pytest [args]``) and ``repo_path``. The repository is
``repo_path`` when given, else ``<repos_dir>/<owner>__<name>`` or ``<repos_dir>/<owner>/<name>``: a
clone or a ``git clone --mirror``, read with ``git archive`` (no network, ever).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.envs.swe.bundled import SPLITS
from lit_marl.envs.swe.bundled import write as write_bundled
from lit_marl.models import cache_dir

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
TEST_CONFIG = {
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "pytest.toml",
    ".pytest.toml",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "noxfile.py",
}
"""Files that configure pytest (plugins, options): test infrastructure, restored before scoring."""


def load_instances(path: str, field: str = "data.train_path") -> list[dict]:
    """The rows of a local JSONL/JSON/Parquet/CSV file of instances, read with ``datasets``, each
    checked and normalized (``FAIL_TO_PASS``/``PASS_TO_PASS`` as lists)."""
    # deferred: importing datasets costs ~1 s of start-up that runs without SWE tasks skip
    import datasets

    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"{field}={path!r}: no such instance file (write the bundled ones with scripts/make_swe_repos.py)"
        )
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(file.suffix)
    if kind is None:
        raise ConfigError(f"{field}={path!r}: give a .jsonl, .json, .parquet or .csv file of SWE-Gym instances")
    try:
        table = datasets.load_dataset(kind, data_files=str(file), split="train")
    except Exception as err:  # datasets' own errors vary by format
        raise ConfigError(f"{field}={path!r}: not readable as {kind} ({type(err).__name__}: {err})") from err
    rows = [normalize(dict(row), f"{field}={path!r} row {i + 1}") for i, row in enumerate(table)]
    if not rows:
        raise ConfigError(f"{field}={path!r}: holds no instances")
    seen = set()
    for row in rows:
        if row["instance_id"] in seen:
            raise ConfigError(f"{field}={path!r}: instance_id {row['instance_id']!r} appears twice")
        seen.add(row["instance_id"])
    return rows


def resolve_source(source: str, field: str = "data.train_path") -> str:
    """``swe:bundled:<train|test|all>``: the bundled instances (their repositories written once under
    ``$LIT_MARL_CACHE/swe``); ``swe:pypi:<train|test|all>[:<k>]``: the PyPI set (``pypi_set.py``), built
    once by ``scripts/make_swe_pypi.py`` under ``$LIT_MARL_CACHE/swe/pypi`` (``k``: the first k instances
    of each project); ``swe:<file>``: a local
    SWE-Gym file (JSONL, JSON, Parquet, CSV) read with ``datasets`` and written as checked JSONL rows
    beside the cache; the task file's path."""
    rest = source.split(":", 1)[1]
    if rest.startswith("bundled"):
        split = rest.split(":", 1)[1] if ":" in rest else "all"
        if split not in (*SPLITS, "all"):
            raise ConfigError(f"{field}={source!r}: the bundled splits are {', '.join([*SPLITS, 'all'])}")
        return str(write_bundled(cache_dir() / "swe")[split])
    if rest == "pypi" or rest.startswith("pypi:"):
        return pypi_split(source, rest.split(":")[1:], field)
    return write_rows(Path(rest).stem, load_instances(rest, field))


def pypi_split(source: str, parts: list[str], field: str) -> str:
    """``swe:pypi[:<split>[:<k>]]``: the PyPI set's split file; with ``k``, the first ``k`` instances
    of each project (by id), written beside the cache (a small evaluation set that still covers
    every project)."""
    split = parts[0] if parts else "all"
    per_project = parts[1] if len(parts) > 1 else None
    if split not in ("train", "test", "all") or len(parts) > 2 or not (per_project is None or per_project.isdigit()):
        raise ConfigError(f"{field}={source!r}: give swe:pypi:<train|test|all>[:<instances per project>]")
    path = cache_dir() / "swe" / "pypi" / f"{split}.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{field}={source!r}: the PyPI set is not built ({path} is missing); build it once with "
            "`python scripts/make_swe_pypi.py` (or `make swe-pypi`; it downloads the pinned sdists)"
        )
    if per_project is None:
        return str(path)
    kept: dict[str, list[dict]] = {}
    for row in sorted(load_instances(str(path), field), key=lambda row: row["instance_id"]):
        group = kept.setdefault(row["repo"], [])
        if len(group) < int(per_project):
            group.append(row)
    return write_rows(f"pypi-{split}-{per_project}", [row for group in kept.values() for row in group])


def write_rows(stem: str, rows: list[dict]) -> str:
    """``rows`` as JSONL under the cache, named by their content (written once, atomically)."""
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    out = cache_dir() / "swe" / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:8]}.jsonl"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, out)
    return str(out)


def normalize(row: dict, where: str) -> dict:
    missing = [key for key in REQUIRED if row.get(key) in (None, "")]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)} (SWE-Gym's fields: {', '.join(REQUIRED)})")
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        value = row[key]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: {key} is neither a list nor the JSON text of one ({err})") from err
        if not isinstance(value, list) or not all(isinstance(v, str) and "::" in v for v in value):
            raise ConfigError(
                f"{where}: {key} must list pytest node ids ('tests/test_x.py::test_y'), got {value!r:.200}"
            )
        row[key] = list(value)
    if not row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]:
        raise ConfigError(f"{where}: FAIL_TO_PASS and PASS_TO_PASS are both empty: nothing to score")
    row["test_args"] = pytest_args(row.get("test_cmd") or "pytest", where)
    for key in ("patch", "test_patch", "repo_path"):
        row[key] = row.get(key) or ""
    return row


def pytest_args(command: str, where: str) -> list[str]:
    """The extra pytest arguments of a ``test_cmd`` (``pytest -x``, ``python -m pytest -p xdist``)."""
    words = shlex.split(command)
    for head in (["pytest"], ["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
        if words[: len(head)] == head:
            return [w for w in words[len(head) :] if "::" not in w and not w.endswith(".py")]
    raise ConfigError(f"{where}: test_cmd={command!r}: only pytest runs the listed tests; give 'pytest [options]'")


def repo_folder(row: dict, repos_dir: str | None) -> Path:
    """Where the instance's repository is on disk, or an error saying how to put it there."""
    candidates = [Path(row["repo_path"])] if row["repo_path"] else []
    if repos_dir:
        owner_name = str(row["repo"])
        candidates += [Path(repos_dir) / owner_name.replace("/", "__"), Path(repos_dir) / owner_name]
    for folder in candidates:
        if folder.is_dir():
            return folder
    raise ConfigError(
        f"instance {row['instance_id']}: no local copy of {row['repo']} (looked in {[str(c) for c in candidates]}); "
        f"clone it there (git clone --mirror https://github.com/{row['repo']}.git) or set data.env_kwargs.repos_dir"
    )


@functools.lru_cache(maxsize=16)
def _snapshot(folder: str, commit: str) -> tuple[tuple[str, bytes, int], ...]:
    try:
        data = subprocess.run(
            ["git", "-C", folder, "archive", "--format=tar", commit], check=True, capture_output=True
        ).stdout
    except subprocess.CalledProcessError as err:
        raise ConfigError(
            f"git archive {commit} in {folder} failed: {err.stderr.decode(errors='replace').strip()}"
        ) from err
    files = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                files.append((member.name, tar.extractfile(member).read(), member.mode & 0o777))
    return tuple(files)


def snapshot(row: dict, repos_dir: str | None) -> dict[str, tuple[bytes, int]]:
    """The repository's files at ``base_commit``: path -> (bytes, mode); cached per commit."""
    folder = repo_folder(row, repos_dir)
    return {name: (data, mode) for name, data, mode in _snapshot(str(folder.resolve()), str(row["base_commit"]))}


def is_test_path(path: str, tests: list[str]) -> bool:
    """Test code or test configuration: restored from the base commit before scoring."""
    parts = Path(path).parts
    name = parts[-1] if parts else ""
    listed = {test.split("::", 1)[0] for test in tests}
    return (
        path in listed
        or name in TEST_CONFIG
        or any(p in ("tests", "test", "testing") for p in parts[:-1])
        or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")))
    )


# --------------------------------------------------------------------------- unified diffs
@dataclass(frozen=True)
class Hunk:
    path: str
    old: str
    """The hunk's context and removed lines (what it replaces); empty for a new file."""
    new: str
    created: bool = False
    deleted: bool = False


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def parse_patch(patch: str) -> list[Hunk]:
    """A git-style unified diff as hunks (each: the file, its old text, its new text)."""
    hunks: list[Hunk] = []
    path, source, created, deleted, old, new, inside = None, None, False, False, [], [], False

    def flush():
        if path is not None and inside:
            hunks.append(Hunk(path, "".join(old), "".join(new), created, deleted))

    for line in patch.splitlines(keepends=True):
        if line.startswith("diff --git "):
            flush()
            path, created, deleted, old, new, inside = None, False, False, [], [], False
        elif line.startswith("--- ") and not inside:
            source = line[4:].strip()
            created = source == "/dev/null"
            source = source[2:] if source.startswith("a/") else source
        elif line.startswith("+++ ") and not inside:
            target = line[4:].strip()
            deleted = target == "/dev/null"
            path = source if deleted else target[2:] if target.startswith("b/") else target
        elif _HUNK.match(line):
            flush()
            old, new, inside = [], [], True
        elif inside and line.startswith((" ", "-", "+")):
            (old if line[0] in " -" else []).append(line[1:])
            (new if line[0] in " +" else []).append(line[1:])
        elif inside and line.startswith("\\"):  # "\ No newline at end of file"
            for side in (old, new):
                if side and side[-1].endswith("\n"):
                    side[-1] = side[-1][:-1]
    flush()
    return hunks


def apply_patch(files: dict[str, bytes], patch: str, what: str) -> dict[str, bytes]:
    """``files`` (path -> bytes) with ``patch`` applied; an error names the hunk that does not fit."""
    out = dict(files)
    for hunk in parse_patch(patch):
        if hunk.created:
            out[hunk.path] = hunk.new.encode()
            continue
        if hunk.deleted:
            out.pop(hunk.path, None)
            continue
        text = out.get(hunk.path, b"").decode(errors="replace")
        if hunk.old not in text:
            raise ValueError(f"{what}: a hunk of {hunk.path} does not apply (its old lines are not in the file)")
        out[hunk.path] = text.replace(hunk.old, hunk.new, 1).encode()
    return out
