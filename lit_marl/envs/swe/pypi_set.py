"""Real repositories as SWE-Gym instances: released pure-Python projects (their PyPI sdists) with
synthesized regressions, in the spirit of SWE-smith.

A project's sdist is cut to its package and its tests (``layout``), its suite made green (test files
that do not import are dropped, failing tests removed) and run once traced, to learn which source
lines the tests reach. Seeded AST-level mutations of those lines (``OPERATORS``: a flipped
comparison, ``and``/``or`` swapped, an off-by-one, a dropped statement, swapped arguments, ...),
each one minimal text edit, are tried one by one with the whole suite; a mutant that breaks 1 to
``max_fail`` tests becomes an instance. Its base commit has the mutated source and, as in SWE-Gym,
no trace of the tests that catch it (their functions removed; ``test_patch`` adds them back); the
gold ``patch`` undoes the mutation. Every instance is then checked through ``scoring.score``: the
base fails each FAIL_TO_PASS test and passes each PASS_TO_PASS one, the gold patch passes all.

``build_set`` writes ``<out>/repos/<project>`` (git, fixed authors and dates: the same commits
everywhere), ``<out>/{train,test,all}.jsonl`` (split by project) and ``<out>/manifest.json``;
sdists are downloaded once into ``<out>/sdists`` (``pip download``; never at run time).
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.envs.swe import instances, scoring
from lit_marl.envs.swe.pypi_mutations import functions, make_patch, problem_statement, remove_tests, test_node
from lit_marl.envs.swe.pypi_suite import BuildError, BuildSettings, Kept, green_suite, search, write_files
from lit_marl.envs.swe.tools_site import distributions

FORMAT = 2
"""Bumped when the instances a build writes change: older project records are rebuilt."""
PROJECTS = {
    "boltons": "26.2.0", "cachetools": "8.0.2", "idna": "3.20", "inflection": "0.5.1", "isodate": "0.7.2",
    "parse": "1.22.4", "pathspec": "1.1.1", "rfc3986": "2.0.0", "semver": "3.1.2", "six": "1.17.0",
    "sqlparse": "0.6.1", "tabulate": "0.10.0", "toml": "0.10.2", "toolz": "1.2.0", "uritemplate": "4.2.0",
    "xmltodict": "1.0.4",
}  # fmt: skip
"""The pinned projects: pure Python, a pytest suite in the sdist that runs offline in seconds."""
SPLITS = {
    "train": ["boltons", "cachetools", "idna", "parse", "pathspec", "rfc3986", "six", "sqlparse", "tabulate", "toml",
              "toolz"],
    "test": ["inflection", "isodate", "semver", "uritemplate", "xmltodict"],
}  # fmt: skip
"""Split by project: the test projects are never seen in training."""
GIT_ENV = {
    "GIT_AUTHOR_NAME": "lit_marl", "GIT_AUTHOR_EMAIL": "lit_marl@localhost",
    "GIT_COMMITTER_NAME": "lit_marl", "GIT_COMMITTER_EMAIL": "lit_marl@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent",
}  # fmt: skip
KEEP_TOP = re.compile(r"(?i)^(readme|license|licence|copying|authors)[^/]*$|^(pyproject\.toml|setup\.cfg|pytest\.ini)$")
TEST_DIRS = ("tests", "test", "testing")
NOT_CODE = {"docs", "doc", "examples", "example", "benchmarks", "benchmark", "tools", "scripts", "bin"}
JUNK = {"__pycache__", ".git", ".github", ".tox", ".pytest_cache", ".mypy_cache"}


# --------------------------------------------------------------------------- the project's files
def read_sdist(sdist: Path) -> dict[str, bytes]:
    """The files of an sdist (``.tar.gz``, ``.zip`` or an unpacked folder), paths under its top folder."""
    files: dict[str, bytes] = {}
    if sdist.is_dir():
        for path in sorted(sdist.rglob("*")):
            if path.is_file() and not path.is_symlink():
                files[path.relative_to(sdist).as_posix()] = path.read_bytes()
        return files
    if sdist.name.endswith(".zip"):
        with zipfile.ZipFile(sdist) as archive:
            files = {i.filename: archive.read(i) for i in archive.infolist() if not i.is_dir()}
    else:
        with tarfile.open(sdist) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    if len({p.split("/", 1)[0] for p in files}) == 1 and all("/" in p for p in files):
        files = {p.split("/", 1)[1]: data for p, data in files.items()}
    return files


def _imports(data: bytes) -> set[str]:
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def layout(files: dict[str, bytes]) -> dict[str, bytes]:
    """The repository's files: the packages and modules the tests import (a ``src/`` layout moved to
    the top, so the repository's own code is what the tests import), the tests, README, LICENSE,
    the project's config and the data files a test names; no docs, CI config or build scripts."""
    files = {p: d for p, d in files.items() if not set(p.split("/")) & JUNK and not p.endswith((".pyc", ".so"))}
    src = "src/" if any(p.startswith("src/") and p.endswith(".py") for p in files) else ""
    units: dict[str, dict[str, bytes]] = {}  # importable top-level name -> its files, at their new paths
    for path, data in files.items():
        if not path.startswith(src):
            continue
        rel = path[len(src) :]
        head, _, rest = rel.partition("/")
        if rest and f"{src}{head}/__init__.py" in files and head not in (*TEST_DIRS, *NOT_CODE):
            units.setdefault(head, {})[rel] = data
        elif not rest and rel.endswith(".py") and not rel.startswith(("test_", "setup.", "conftest.", "noxfile.")):
            units.setdefault(rel[:-3], {})[rel] = data
    tests = {
        p: d
        for p, d in files.items()
        if (p.split("/", 1)[0] in TEST_DIRS and "/" in p)
        or (
            "/" not in p
            and p.endswith(".py")
            and (p.startswith("test_") or p.endswith("_test.py") or p == "conftest.py")
        )
    }
    wanted = {name for name, unit in units.items() if any(instances.is_test_path(p, []) for p in unit)}
    todo = [d for p, d in tests.items() if p.endswith(".py")] + [d for n in wanted for d in units[n].values()]
    while todo:
        for name in _imports(todo.pop()) & (set(units) - wanted):
            wanted.add(name)
            todo += [d for p, d in units[name].items() if p.endswith(".py")]
    if not any(p.endswith(".py") and instances.is_test_path(p, []) for p in tests) and not wanted:
        raise BuildError("the sdist holds no pytest tests")
    out = {p: d for name in sorted(wanted) for p, d in units[name].items()} | tests
    texts = b"\n".join(d for p, d in out.items() if p.endswith(".py"))
    for path, data in files.items():
        if "/" not in path and (
            KEEP_TOP.match(path) or ("." in path[1:] and not path.endswith(".py") and path.encode() in texts)
        ):
            out.setdefault(path, data)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- instances
def _git(repo: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> str:
    run = subprocess.run(
        ["git", "-C", str(repo), *args],
        env={**os.environ, **GIT_ENV, **(env or {})},
        input=data,
        check=True,
        capture_output=True,
    )
    return run.stdout.decode().strip()


def write_pristine(repo: Path, files: dict[str, bytes], message: str) -> str:
    """``repo`` as a fresh git repository holding the released files; their commit."""
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    write_files(repo, files)
    _git(repo, "add", "-A", "-f")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def commit_files(repo: Path, pristine: str, changed: dict[str, str], message: str, ref: str) -> str:
    """A commit (no parent: its history shows no fix) of the pristine tree with ``changed``, kept by
    ``refs/instances/<ref>``; its id."""
    env = {"GIT_INDEX_FILE": str(repo / ".git" / "instance-index")}
    _git(repo, "read-tree", pristine, env=env)
    for path, text in sorted(changed.items()):
        blob = _git(repo, "hash-object", "-w", "--stdin", data=text.encode())
        _git(repo, "update-index", "--cacheinfo", f"100644,{blob},{path}", env=env)
    commit = _git(repo, "commit-tree", _git(repo, "write-tree", env=env), "-m", message)
    _git(repo, "update-ref", f"refs/instances/{ref}", commit)
    return commit


def _module(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def _doc(node: ast.AST | None) -> str:
    """The first sentence of a docstring (empty when short, or when there is none)."""
    text = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split()) if node else ""
    text = re.split(r"(?<=[.!?])\s", text)[0]
    return text if 8 < len(text) <= 160 else ""


def _public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def subjects(files: dict[str, bytes], kept: Kept) -> list[str]:
    """What the problem statement names: each mutated function when it is public (with its
    docstring's first sentence), else the package's public functions and classes the broken tests
    call (``pkg.mod.func()``), else the module."""
    defined: dict[str, set[str]] = {}  # a name the tests may call -> the public places defining it
    for path in sorted(p for p in files if p.endswith(".py") and not instances.is_test_path(p, [])):
        for name, _ in functions(ast.parse(files[path])):
            if _public(f"{_module(path)}.{name}"):
                defined.setdefault(name.rsplit(".", 1)[-1], set()).add(f"{_module(path)}.{name}")
    public = {name: places.pop() for name, places in defined.items() if len(places) == 1}
    out = []
    for mutation in kept.mutations:
        if _public(f"{_module(mutation.path)}.{mutation.function}"):
            node = next((n for q, n in functions(ast.parse(files[mutation.path])) if q == mutation.function), None)
            doc = _doc(node)
            out.append(f"`{_module(mutation.path)}.{mutation.function}()`" + (f' ("{doc}")' if doc else ""))
            continue
        called = []
        for test in kept.fail:
            path, name = test.split("[", 1)[0].split("::", 1)
            for node in ast.walk(test_node(ast.parse(files[path]), name)[-1]):
                func = node.func if isinstance(node, ast.Call) else None
                called.append(getattr(func, "attr", None) or getattr(func, "id", None))
        names = [f"`{public[n]}()`" for n in dict.fromkeys(called) if n in public][:2]
        out.append(" and ".join(names) if names else f"the code behind `{_module(mutation.path)}`")
    return out


def _pass_to_pass(kept: Kept, rng: random.Random, limit: int) -> list[str]:
    """A sample of the tests that pass with the mutation: from the broken tests' files first."""
    files = {t.split("::", 1)[0] for t in kept.fail}
    near = [t for t in kept.passing if t.split("::", 1)[0] in files]
    far = [t for t in kept.passing if t.split("::", 1)[0] not in files]
    chosen = rng.sample(near, min(len(near), limit))
    chosen += rng.sample(far, max(0, min(len(far), min(5, limit) - len(chosen))))
    return sorted(chosen)


def make_instance(
    project: str,
    version: str,
    files: dict[str, bytes],
    kept: Kept,
    number: int,
    repo: Path,
    pristine: str,
    settings: BuildSettings,
) -> dict:
    """The instance row of a kept mutant, its base commit written in ``repo``: the mutated source and
    the test files without the tests it breaks (``test_patch`` adds them back); the gold ``patch``."""
    changed: dict[str, str] = {}
    for mutation in sorted(kept.mutations, key=lambda m: (m.path, -m.line, -m.start)):
        changed[mutation.path] = mutation.apply(changed.get(mutation.path, files[mutation.path].decode()))
    hide: dict[str, list[str]] = {}
    for test in kept.fail:
        path, name = test.split("[", 1)[0].split("::", 1)
        hide.setdefault(path, []).append(name)
    hidden = {path: remove_tests(files[path].decode(), names) for path, names in hide.items()}
    original = {path: files[path].decode() for path in [*changed, *hidden]}
    instance_id = f"pypi__{project}-{number:03d}"
    message = f"{project} {version}: " + "; ".join(m.describe() for m in kept.mutations)
    return {
        "instance_id": instance_id,
        "repo": f"pypi/{project}",
        "repo_path": str(repo.resolve()),
        "base_commit": commit_files(repo, pristine, {**changed, **hidden}, message, instance_id),
        "problem_statement": problem_statement(project, version, subjects(files, kept), kept.messages),
        "FAIL_TO_PASS": sorted(kept.fail),
        "PASS_TO_PASS": _pass_to_pass(kept, random.Random(f"{settings.seed}:{instance_id}"), settings.max_p2p),
        "patch": make_patch(changed, {p: original[p] for p in changed}, "patch"),
        "test_patch": make_patch(hidden, {p: original[p] for p in hidden}, "test_patch"),
        "test_cmd": "pytest",
        "version": version,
        "mutation": "; ".join(m.describe() for m in kept.mutations),
    }


def validate(row: dict, root: Path, tests: scoring.TestSettings) -> str:
    """Empty when the instance holds under the real scorer: its base commit fails every FAIL_TO_PASS
    test and passes every PASS_TO_PASS one, and the gold patch passes them all; else what breaks."""
    row = instances.normalize(dict(row), f"instance {row['instance_id']}")
    base = instances.snapshot(row, None)
    files = {path: data for path, (data, _) in base.items()}
    try:
        before = scoring.score(row, base, files, root, tests)
        after = scoring.score(row, base, instances.apply_patch(files, row["patch"], "patch"), root, tests)
    except (RuntimeError, ValueError) as err:  # the scorer's HarnessError, a patch that does not apply
        return f"{type(err).__name__}: {err}"[:300]
    for label, score in (("base commit", before), ("gold patch", after)):
        if score.tampered:  # the workspace's path out, so that reasons group
            return f"the scorer refused the {label}: " + re.sub(r"/\S*/ws-[0-9a-f]+/", "", score.tampered)[:200]
    wrong = [(t, "failed") for t in row["FAIL_TO_PASS"] if before.outcomes.get(t) != "failed"]
    wrong += [(t, "passed") for t in row["PASS_TO_PASS"] if before.outcomes.get(t) != "passed"]
    wrong += [(t, "gold") for t, outcome in after.outcomes.items() if outcome != "passed"]
    if wrong:
        test, want = wrong[0]
        score = after if want == "gold" else before
        where = "with the gold patch" if want == "gold" else f"on the base commit (not {want})"
        return f"{test} is {score.outcomes.get(test, 'missing')} {where}"
    return ""


def check_rows(rows: list[dict], tests: scoring.TestSettings | None = None) -> tuple[list[dict], dict[str, str]]:
    """The rows that ``validate`` accepts, and why each other one fails."""
    valid, invalid = [], {}
    with tempfile.TemporaryDirectory(prefix="swe-pypi-ws-") as root:
        for row in rows:
            problem = validate(row, Path(root), tests or scoring.TestSettings())
            if problem:
                invalid[row["instance_id"]] = problem
            else:
                valid.append(row)
    return valid, invalid


def _counts(record: dict, rows: list[dict], tests: scoring.TestSettings | None) -> dict:
    """``record`` with ``rows`` (every instance made) checked again and its counts updated."""
    valid, invalid = check_rows(rows, tests)
    kinds: dict[str, int] = {}
    for reason in invalid.values():
        kind = re.sub(r"\S+::\S+|\S+\.py\b|'[^']*'", "X", reason)
        kinds[kind] = kinds.get(kind, 0) + 1
    record.update(kept=len(rows), validated=len(valid), invalid=invalid, invalid_kinds=kinds)
    record.update(rows=valid, made=rows, doubles=sum("; " in r["mutation"] for r in valid))
    return record


# --------------------------------------------------------------------------- projects and the set
def build_project(
    name: str,
    version: str,
    sdist: Path,
    repo: Path,
    settings: BuildSettings | None = None,
    tests: scoring.TestSettings | None = None,
    log=None,
) -> dict:
    """One project's validated instances and its counts: the sdist (a file or a folder) cut and made
    green, mutants searched, each kept one written as a commit of ``repo`` and checked by ``validate``."""
    start, settings = time.monotonic(), settings or BuildSettings()
    files = layout(read_sdist(sdist))
    with tempfile.TemporaryDirectory(prefix=f"swe-pypi-{name}-") as tmp:
        folder = Path(tmp).resolve()
        files, suite = green_suite(folder, files, settings)
        kept, tried, rejected = search(folder, files, suite, name, settings, log)
    pristine = write_pristine(repo, files, f"{name} {version}: released files, tests made green")
    made = []
    for number, mutant in enumerate(kept, 1):
        try:
            made.append(make_instance(name, version, files, mutant, number, repo, pristine, settings))
        except ValueError as err:  # a test defined elsewhere (inherited), a diff that does not apply back
            rejected[type(err).__name__] = rejected.get(type(err).__name__, 0) + 1
    record = {"project": name, "version": version, "tests": len(suite.tests), "suite_s": round(suite.seconds, 2),
              "tried": tried, "rejected": rejected}  # fmt: skip
    record = _counts(record, made, tests)
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def fetch_sdist(name: str, version: str, cache: Path) -> Path:
    """The sdist of ``name==version``, downloaded once into ``cache`` (``pip download``)."""
    folder = cache / f"{name}=={version}"
    found = sorted(folder.glob("*")) if folder.is_dir() else []
    if len(found) == 1:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        options = "--quiet --no-deps --no-binary :all: -d".split()
        argv = [sys.executable, "-m", "pip", "download", *options, tmp, f"{name}=={version}"]
        run = subprocess.run(argv, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*"))
        if run.returncode or len(got) != 1:
            raise BuildError(f"pip download {name}=={version} failed: {(run.stderr or run.stdout).strip()[-400:]}")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        os.mkdir(tmp)  # for the context manager's clean-up
    return folder / got[0].name


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_set(
    out: Path,
    projects: dict[str, str] = PROJECTS,
    splits: dict[str, list[str]] = SPLITS,
    settings: BuildSettings | None = None,
    sdists: dict[str, Path] | None = None,
    log=print,
    revalidate: bool = False,
) -> dict:
    """Every project's instances under ``out`` (a project whose record is there, made by the same
    settings, is reused; one without is built again from scratch), the split files and the manifest;
    the manifest. ``sdists``: local sdists by project (the others are downloaded). ``revalidate``:
    every instance a reused project made is checked again by the scorer (after the scorer changed)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = settings or BuildSettings()
    unknown = sorted(set(sum(splits.values(), [])) - set(projects))
    if unknown:
        raise ConfigError(f"splits name projects that are not pinned: {unknown}")
    with open(out / ".lock", "w") as lock:  # one build of a folder at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        start, records = time.monotonic(), {}
        (out / "projects").mkdir(exist_ok=True)
        for name, version in sorted(projects.items()):
            records[name] = _project(out, name, version, settings, (sdists or {}).get(name), log, revalidate)
        return _write_set(out, projects, splits, settings, records, time.monotonic() - start)


def _project(
    out: Path, name: str, version: str, settings: BuildSettings, sdist: Path | None, log, revalidate: bool
) -> dict:
    installed = visible_to_the_tests(name)
    if installed:
        log(f"{name}=={version}: skipped ({installed})")
        return {"project": name, "version": version, "error": installed, "rows": []}
    key = hashlib.sha256(json.dumps([FORMAT, name, version, asdict(settings)]).encode()).hexdigest()[:16]
    path, repo = out / "projects" / f"{name}.json", out / "repos" / name
    if path.is_file() and (repo / ".git").is_dir():
        record = json.loads(path.read_text())
        if record.get("key") == key and not revalidate:
            return record
        if record.get("key") == key:
            start = time.monotonic()
            record = _counts(record, record["made"], None)
            record["validate_s"] = round(time.monotonic() - start, 1)
            _atomic(path, json.dumps(record, indent=1) + "\n")
            return record
    path.unlink(missing_ok=True)  # a half-written or outdated build: from scratch
    try:
        sdist = sdist or fetch_sdist(name, version, out / "sdists")
        record = build_project(name, version, sdist, repo, settings, log=log)
    except BuildError as err:
        log(f"{name}=={version}: skipped ({err})")
        return {"project": name, "version": version, "error": str(err), "rows": []}
    record["key"] = key
    _atomic(path, json.dumps(record, indent=1) + "\n")
    return record


def visible_to_the_tests(name: str, packages: tuple[str, ...] = ()) -> str:
    """Why a project may not be in the set (empty: it may): the test runs' interpreter has it installed
    (pytest's own requirements, ``tests.packages``: the tools' site folder, ``tools_site``), so a
    released version, fixed, could stand in for the repository. Projects installed elsewhere beside
    the trainer stay: the sandbox shows the test runs none of them."""
    names = {dist.metadata["Name"].lower().replace("_", "-") for dist in distributions(("pytest", *packages))}
    if name.lower().replace("_", "-") in names:
        return f"installed where the tests run ({name}, beside pytest): a released version could stand in for the fix"
    return ""


def _merged(counts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for count in counts:
        for kind, n in count.items():
            out[kind] = out.get(kind, 0) + n
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def _write_set(out: Path, projects, splits, settings: BuildSettings, records: dict, seconds: float) -> dict:
    split_of = {name: split for split, names in splits.items() for name in names}
    rows = {split: [] for split in [*splits, "all"]}
    for name in sorted(projects):
        for row in records[name]["rows"]:
            row = {**row, "task_type": split_of.get(name, "all")}
            rows["all"].append(row)
            if name in split_of:
                rows[split_of[name]].append(row)
    for split, items in rows.items():
        _atomic(out / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in items))
    kept = sum(r.get("kept", 0) for r in records.values())
    manifest = {
        "format": FORMAT,
        "settings": asdict(settings),
        "projects": {
            n: {**{k: v for k, v in r.items() if k not in ("rows", "made", "key")}, "split": split_of.get(n, "")}
            for n, r in records.items()
        },
        "counts": {split: len(items) for split, items in rows.items()},
        "build_seconds": round(sum(r.get("seconds", 0) for r in records.values()), 1),
        "this_run_seconds": round(seconds, 1),
        "validation_rate": round(len(rows["all"]) / kept, 4) if kept else 0.0,
        "invalid_kinds": _merged([r.get("invalid_kinds", {}) for r in records.values()]),
    }
    _atomic(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
