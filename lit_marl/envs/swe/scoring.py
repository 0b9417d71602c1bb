"""Scoring an agent's changes by the instance's tests, on a fresh copy, in the sandbox.

The copy is the base commit, plus the agent's changes to files that are not tests (``is_test_path``:
test files and pytest's configuration come from the base commit; test files the agent added are
left out), plus the instance's ``test_patch`` (where SWE-Gym's instances keep the FAIL_TO_PASS
tests). Files that change what gets imported without being source are never carried into the copy
(``carried``: bytecode, ``__pycache__``, packaging metadata, ``.pth`` files, native extensions), and
a new module that shadows an existing one (a package beside a module of the same name, a top-level
module named like the standard library's or an installed one) is refused as tampering before
anything runs (``shadowing``).

Only FAIL_TO_PASS and PASS_TO_PASS run, under ``runner.py`` (read its docstring: the verdict is kept
in an audit hook the code under test cannot reach, the report is signed with a per-run key, and the
routes by which code could reach the test machinery are tripwires); a listed test that does not pass,
or is not collected, counts as failed; a run with tampering scores every listed test failed.

A run that gives no report is retried (``retries``). When every try fails, the base commit is run
once: if it reports, the agent's code broke the run (scored, counted as ``agent_crashes``); if it
does not, the harness itself is broken and ``HarnessError`` stops the run (never a silent 0).
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import importlib.util
import json
import os
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from lit_marl.envs.swe.instances import apply_patch, is_test_path
from lit_marl.envs.swe.tools_site import tools_site
from lit_marl.envs.swe.workspace import Workspace
from lit_marl.fields import NonNegativeInt, PositiveFloat, PositiveInt, check_dataclass
from lit_marl.sandbox import Limits, Result, run_in

RUNNER = str(Path(__file__).with_name("runner.py"))
HARNESS = tuple(
    str(Path(__file__).with_name(name)) for name in ("harness.py", "harness_checks.py", "harness_equality.py")
)
_PYTEST = importlib.util.find_spec("pytest")  # found, not imported: the trainer never runs it
SITE = str(Path(_PYTEST.origin).resolve().parent.parent) if _PYTEST else ""
"""The folder holding pytest (the trainer's site-packages): what a workspace module may not shadow.
Test runs see only the tools' own site folder (``tools_site``)."""
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".pth", ".so", ".pyd", ".dylib", ".egg-link")
SKIPPED_FOLDERS = ("__pycache__",)
SKIPPED_FOLDER_SUFFIXES = (".dist-info", ".egg-info")
INSTALLED = frozenset(
    name.split(".")[0].split("-")[0] for name in (os.listdir(SITE) if SITE else []) if not name.startswith(("_", "."))
) | frozenset(sys.stdlib_module_names)
"""Top-level module names a workspace file may not take (the standard library's, the installed ones')."""


class HarnessError(RuntimeError):
    """The test harness itself fails (also on the untouched base commit): a run cannot be scored."""


@dataclass(frozen=True)
class TestSettings:
    """How tests run (the ``test`` tool and scoring)."""

    __test__ = False  # not a pytest class

    test_timeout_s: PositiveFloat = 30.0
    """Seconds per test; a longer test fails."""
    run_timeout_s: PositiveFloat = 300.0
    """Wall seconds of a whole test run (pytest's start and collection included)."""
    memory_mb: PositiveInt = 2048
    """Address space (RLIMIT_AS) of each process of a test run."""
    processes: PositiveInt = 64
    """Processes and threads of a test run's sandbox user (RLIMIT_NPROC)."""
    file_mb: PositiveInt = 64
    """Largest file a test run may write."""
    disk_mb: PositiveInt = 256
    """Everything a test run may write, in total."""
    retries: NonNegativeInt = 2
    """Further tries of a run in which the harness never became ready (the sandbox or the interpreter
    failed, or it timed out first); a run the code under test broke is not tried again."""
    log_chars: PositiveInt = 3000
    """Characters of pytest's output kept (the end of it)."""
    packages: tuple[str, ...] = ()
    """Installed distributions the repositories' tests import (with what they require), shown to the
    test runs and ``run`` commands beside pytest; nothing else of the trainer's environment is."""

    def __post_init__(self):
        check_dataclass("data.env_kwargs.tests", self)

    def limits(self) -> Limits:
        return Limits(wall_s=self.run_timeout_s, cpu_s=int(self.run_timeout_s) + 1, memory_mb=self.memory_mb,
                      processes=self.processes, file_mb=self.file_mb, disk_mb=self.disk_mb,
                      output_chars=self.log_chars + 200_000)  # fmt: skip


@dataclass
class Report:
    outcomes: dict[str, str]
    exit: int
    log: str
    tampered: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the runner noted (the pytest that ran, with its folder; how a run ended early)."""
    complete: bool = True
    """The run's lines all came, in order, up to its last (False: the harness was ready but the run
    broke off or lost a line: the code under test broke it)."""


@dataclass
class Score:
    outcomes: dict[str, str] = field(default_factory=dict)
    """Each listed test: ``passed``, ``failed``, ``skipped``, ``missing`` (not collected)."""
    tampered: str = ""
    """Why the run counts as tampered (empty: it does not): a shadowing module refused before running,
    or the first tripwire the run hit."""
    retries: int = 0
    agent_crash: bool = False
    log: str = ""

    @property
    def passed(self) -> int:
        return sum(outcome == "passed" for outcome in self.outcomes.values())

    @property
    def fraction(self) -> float:
        return self.passed / len(self.outcomes) if self.outcomes else 0.0

    @property
    def resolved(self) -> bool:
        return bool(self.outcomes) and self.passed == len(self.outcomes)


def run_tests(
    ws: Workspace, tests: list[str], args: list[str], settings: TestSettings, changed: dict | None = None
) -> tuple[Report | None, Result]:
    """Run ``tests`` in the workspace (sandboxed); ``changed`` maps each file the agent wrote (the
    untrusted code) to its changed lines (None: a new file, all of it). The report, or None when no
    report signed with this run's key came back."""
    changed = changed or {}
    key = secrets.token_bytes(32)
    interpreter = os.path.realpath(sys.executable)
    site = tools_site(settings.packages)
    argv = [interpreter, "-I", "-B", RUNNER, site, str(ws.path.resolve()), str(settings.log_chars),
            str(settings.test_timeout_s), *args]  # fmt: skip
    lines = {path: lines for path, lines in changed.items() if lines is not None}
    stdin = key.hex() + "\n" + json.dumps({"tests": list(tests), "changed": sorted(changed), "lines": lines})
    result = run_in(argv, str(ws.path), settings.limits(), read_only=(RUNNER, *HARNESS, site), stdin=stdin)
    return signed_report(result.stdout, key), result


def signed_report(stdout: str, key: bytes) -> Report | None:
    """The run's lines in ``stdout`` signed with ``key`` (``<hmac> <seq> <kind> <hex field>...``, written
    by the harness as it decides) as a Report; None when the harness never said it was ready (no code of
    the workspace ran: the run may be tried again). Lines must come numbered 0, 1, 2, ... and end with
    ``finish``; a gap, a repeat or a missing end is a broken run (``complete`` False), as the code under
    test can drop or replay lines but not make one."""
    lines = []
    for line in stdout.splitlines():
        mac, _, body = line.partition(" ")
        if len(mac) == 64 and hmac.compare_digest(mac, hmac.new(key, body.encode(), hashlib.sha256).hexdigest()):
            seq, kind, *fields = body.split(" ")
            lines.append((int(seq), kind, [bytes.fromhex(f).decode("utf-8", "surrogateescape") for f in fields]))
    if not lines or lines[0][:2] != (0, "ready"):
        return None
    report, failed = Report({}, -1, "", complete=False), set()
    for expected, (seq, kind, fields) in enumerate(lines):
        if seq != expected or report.complete:
            report.complete = False
            break
        if kind == "outcome":
            report.outcomes[fields[0]] = fields[1]
        elif kind == "failed":
            failed.add(fields[0])
        elif kind == "tamper":
            report.tampered.append(fields[0])
        elif kind == "note":
            report.notes.append(fields[0])
        elif kind == "finish":
            report.exit, report.log, report.complete = int(fields[0]), fields[1], True
    report.outcomes.update({nodeid: "failed" for nodeid in failed if nodeid in report.outcomes})
    return report


def changed_lines(base: dict, changes: dict[str, bytes]) -> dict[str, list[int] | None]:
    """Each changed file's changed lines (numbers in the new file: replaced and inserted lines, and
    the two lines around a deletion); None for a new file."""
    out: dict[str, list[int] | None] = {}
    for path, data in changes.items():
        if path not in base:
            out[path] = None
            continue
        old, new = base[path][0].decode(errors="replace").splitlines(), data.decode(errors="replace").splitlines()
        lines: set[int] = set()
        for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag != "equal":
                lines.update(range(j1 + 1, j2 + 1) if j2 > j1 else (j1, j1 + 1))
        out[path] = sorted(lines)
    return out


def carried(path: str) -> bool:
    """Whether an agent's file goes into the scoring copy: never bytecode, packaging metadata, path
    files or native extensions (they change what gets imported without being source)."""
    parts = Path(path).parts
    return not (
        path.endswith(SKIPPED_SUFFIXES)
        or any(p in SKIPPED_FOLDERS or p.endswith(SKIPPED_FOLDER_SUFFIXES) for p in parts[:-1])
    )


def shadowing(base: dict, changes: dict[str, bytes]) -> str:
    """The first new module of ``changes`` that shadows an existing one (empty: none): a package
    ``a/b/__init__.py`` beside a module ``a/b.py``, or a top-level module named like one of the
    standard library or of the installed packages."""
    for path in sorted(changes):
        if path in base or not path.endswith(".py"):
            continue
        parts = Path(path).parts
        if parts[-1] == "__init__.py" and str(Path(*parts[:-1])) + ".py" in base:
            return f"{path}: a package that shadows the module {str(Path(*parts[:-1]))}.py"
        top = parts[0][:-3] if len(parts) == 1 else parts[0] if parts[-1] == "__init__.py" and len(parts) == 2 else ""
        if top in INSTALLED and not any(p.split("/")[0] in (top, top + ".py") for p in base):
            return f"{path}: a module that shadows the installed module {top!r}"
    return ""


def scoring_files(
    base: dict[str, tuple[bytes, int]], current: dict[str, bytes], tests: list[str], test_patch: str
) -> tuple[dict[str, tuple[bytes, int]], dict[str, bytes]]:
    """The copy to score (path -> (bytes, mode)) and the agent's changes to non-test files."""
    changes = {
        path: data
        for path, data in current.items()
        if not is_test_path(path, tests) and carried(path) and (path not in base or base[path][0] != data)
    }
    deleted = {path for path in base if path not in current and not is_test_path(path, tests)}
    files = {path: value for path, value in base.items() if path not in deleted and carried(path)}
    for path, data in changes.items():
        files[path] = (data, base[path][1] if path in base else 0o644)
    if test_patch:
        patched = apply_patch({p: d for p, (d, _) in files.items()}, test_patch, "test_patch")
        files = {p: (d, files[p][1] if p in files else 0o644) for p, d in patched.items()}
    for path in clashing(files, changes):  # e.g. a file written where the tests' folder is: the tests stay
        files.pop(path)
        changes.pop(path)
    return files, changes


def clashing(files: dict, changes: dict) -> list[str]:
    """The agent's changed paths that cannot coexist with the other files of the copy: a file where
    a folder of other files is, or a file under a path that is a file."""
    folders = {str(parent) for path in files for parent in Path(path).parents if str(parent) != "."}
    return [
        path
        for path in changes
        if path in folders or any(str(parent) in files for parent in Path(path).parents if str(parent) != ".")
    ]


_baseline: dict[str, bool] = {}
_baseline_lock = threading.Lock()


def _reports(files, root: Path, tests, args, settings: TestSettings, changed=None) -> tuple[Report | None, int, Result]:
    """Up to 1 + retries runs on a fresh copy of ``files`` while none gets as far as the harness being
    ready (a broken run is the code's doing and is not run again); the report (None: none came),
    retries used."""
    ws = Workspace(root, files)
    try:
        for attempt in range(settings.retries + 1):
            report, result = run_tests(ws, tests, args, settings, changed)
            if report is not None:
                return report, attempt, result
        return None, settings.retries, result
    finally:
        ws.remove()


def score(row: dict, base, current: dict[str, bytes], root: Path, settings: TestSettings) -> Score:
    """Score the workspace files ``current`` of instance ``row`` whose base files are ``base``."""
    tests = list(dict.fromkeys(row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]))
    files, changes = scoring_files(base, current, tests, row["test_patch"])
    reason = shadowing(base, changes)
    if reason:
        return Score({test: "failed" for test in tests}, tampered=reason)
    report, retries, result = _reports(files, root, tests, row["test_args"], settings, changed_lines(base, changes))
    failed = {test: "failed" for test in tests}
    if report is not None and report.tampered:
        return Score(failed, tampered="; ".join(report.tampered)[:500], retries=retries, log=report.log)
    if report is None or not report.complete:
        key = f"{row['instance_id']}@{row['base_commit']}"
        with _baseline_lock:
            if key not in _baseline:
                base_files, _ = scoring_files(base, {p: d for p, (d, _) in base.items()}, tests, row["test_patch"])
                kept = _reports(base_files, root, tests, row["test_args"], settings)[0]
                _baseline[key] = kept is not None and kept.complete
        if not _baseline[key]:
            raise HarnessError(
                f"instance {row['instance_id']}: the test harness gave no complete report in {settings.retries + 1} "
                f"tries, also on the base commit (exit {result.returncode}, timed out: {result.timed_out}): "
                f"{(result.stderr or result.stdout)[-600:]!r}; check the repository's test setup "
                "(run its tests by hand) or raise data.env_kwargs.tests.run_timeout_s"
            )
        return Score(failed, retries=retries, agent_crash=True, log=result.stderr[-500:])
    outcomes = {test: report.outcomes.get(test, "missing") for test in tests}
    return Score(outcomes, retries=retries, log=report.log)
