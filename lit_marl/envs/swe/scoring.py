"""Scoring an agent's changes by the instance's tests, on a fresh copy, in the sandbox.

The copy is the base commit, plus the agent's changes to files that are not tests (``is_test_path``:
test files and pytest's configuration come from the base commit; test files the agent added are
left out), plus the instance's ``test_patch``. Only FAIL_TO_PASS and PASS_TO_PASS run (``runner.py``,
each test under its own time limit); a listed test that does not pass, or is not collected, counts
as failed. Added lines of non-test files that reach for the test machinery or the interpreter's
internals (``TAMPER``) are refused before anything runs: the tests and the code under test share
one process, so such code could rewrite the report (a heuristic layer on top of the restoring,
documented in docs/swe.md).

A run that gives no report is retried (``retries``). When every try fails, the base commit is run
once: if it reports, the agent's code broke the run (scored, counted as ``agent_crashes``); if it
does not, the harness itself is broken and ``HarnessError`` stops the run (never a silent 0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from lit_marl.envs.swe.instances import apply_patch, is_test_path
from lit_marl.envs.swe.workspace import Workspace
from lit_marl.fields import NonNegativeInt, PositiveFloat, PositiveInt, check_dataclass
from lit_marl.sandbox import Limits, Result, run_in

RUNNER = str(Path(__file__).with_name("runner.py"))
_PYTEST = importlib.util.find_spec("pytest")  # found, not imported: the trainer never runs it
SITE = str(Path(_PYTEST.origin).resolve().parent.parent) if _PYTEST else ""
"""The folder holding pytest (the trainer's site-packages), visible read-only in the sandbox."""
TAMPER = re.compile(
    r"\b(_?pytest|pluggy|unittest|conftest|sys\s*\.\s*(modules|exit|_getframe)"
    r"|os\s*\.\s*(_exit|kill|dup2?|fork)|atexit|builtins|__builtins__|__import__|importlib|settrace|setprofile"
    r"|f_back|f_globals|f_locals|gc\s*\.|signal|ctypes|faulthandler|inspect|exec|eval)\b"
)
"""What added lines of non-test code may not mention (they could reach into the test run)."""


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
    """Further tries of a run that gave no report (the harness timed out or crashed)."""
    log_chars: PositiveInt = 3000
    """Characters of pytest's output kept (the end of it)."""

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


@dataclass
class Score:
    outcomes: dict[str, str] = field(default_factory=dict)
    """Each listed test: ``passed``, ``failed``, ``skipped``, ``missing`` (not collected)."""
    tampered: str = ""
    """Why the changes were refused without running (empty: they were not)."""
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


def run_tests(ws: Workspace, tests: list[str], args: list[str], settings: TestSettings) -> tuple[Report | None, Result]:
    """Run ``tests`` in the workspace (sandboxed); the report, or None when none came back."""
    nonce = secrets.token_hex(16)
    interpreter = os.path.realpath(sys.executable)
    argv = [interpreter, "-I", "-B", RUNNER, SITE, str(ws.path.resolve()), str(settings.log_chars),
            str(settings.test_timeout_s), *args]  # fmt: skip
    result = run_in(argv, str(ws.path), settings.limits(), read_only=(RUNNER, SITE), stdin="\n".join([nonce, *tests]))
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                data = json.loads(line[len(nonce) + 1 :])
                return Report(dict(data["outcomes"]), int(data["exit"]), str(data["log"])), result
            except (ValueError, KeyError, TypeError):
                break
    return None, result


def scoring_files(
    base: dict[str, tuple[bytes, int]], current: dict[str, bytes], tests: list[str], test_patch: str
) -> tuple[dict[str, tuple[bytes, int]], dict[str, bytes]]:
    """The copy to score (path -> (bytes, mode)) and the agent's changes to non-test files."""
    changes = {
        path: data
        for path, data in current.items()
        if not is_test_path(path, tests) and (path not in base or base[path][0] != data)
    }
    deleted = {path for path in base if path not in current and not is_test_path(path, tests)}
    files = {path: value for path, value in base.items() if path not in deleted}
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


def tampering(base: dict[str, tuple[bytes, int]], changes: dict[str, bytes]) -> str:
    """The first added line of a non-test file that mentions the test machinery (empty: none)."""
    for path in sorted(changes):
        before = set(base[path][0].decode(errors="replace").splitlines()) if path in base else set()
        for line in changes[path].decode(errors="replace").splitlines():
            if line not in before and TAMPER.search(line):
                return f"{path}: {line.strip()[:120]}"
    return ""


_baseline: dict[str, bool] = {}
_baseline_lock = threading.Lock()


def _reports(files, root: Path, tests, args, settings: TestSettings) -> tuple[Report | None, int, Result]:
    """Up to 1 + retries runs on a fresh copy of ``files``; the report (None: none came), retries used."""
    ws = Workspace(root, files)
    try:
        for attempt in range(settings.retries + 1):
            report, result = run_tests(ws, tests, args, settings)
            if report is not None:
                return report, attempt, result
        return None, settings.retries, result
    finally:
        ws.remove()


def score(row: dict, base, current: dict[str, bytes], root: Path, settings: TestSettings) -> Score:
    """Score the workspace files ``current`` of instance ``row`` whose base files are ``base``."""
    tests = list(dict.fromkeys(row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]))
    files, changes = scoring_files(base, current, tests, row["test_patch"])
    reason = tampering(base, changes)
    if reason:
        return Score({test: "failed" for test in tests}, tampered=reason)
    report, retries, result = _reports(files, root, tests, row["test_args"], settings)
    if report is None:
        key = f"{row['instance_id']}@{row['base_commit']}"
        with _baseline_lock:
            if key not in _baseline:
                base_files, _ = scoring_files(base, {p: d for p, (d, _) in base.items()}, tests, row["test_patch"])
                _baseline[key] = _reports(base_files, root, tests, row["test_args"], settings)[0] is not None
        if not _baseline[key]:
            raise HarnessError(
                f"instance {row['instance_id']}: the test harness gave no report in {settings.retries + 1} tries, also "
                f"on the base commit (exit {result.returncode}, timed out: {result.timed_out}): "
                f"{(result.stderr or result.stdout)[-600:]!r}; check the repository's test setup "
                "(run its tests by hand) or raise data.env_kwargs.tests.run_timeout_s"
            )
        return Score({test: "failed" for test in tests}, retries=retries, agent_crash=True, log=result.stderr[-500:])
    outcomes = {test: report.outcomes.get(test, "missing") for test in tests}
    return Score(outcomes, retries=retries, log=report.log)
