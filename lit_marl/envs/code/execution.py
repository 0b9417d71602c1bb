"""Run a program's tests in the sandbox, each test recorded on its own (trainer side).

``split_tests`` turns a HumanEval-style ``check(candidate)`` (or plain top-level asserts, as in
MBPP) into separate tests; ``run_tests`` runs many programs in parallel through
``lit_marl.sandbox``, each under the two-process harness of ``harness.py``, and reads back the
signed per-test report. Anything that keeps the report from arriving (the harness killed, the
wall timeout) counts as no test passed.
"""

from __future__ import annotations

import ast
import json
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from lit_marl.fields import PositiveFloat, PositiveInt, check_dataclass
from lit_marl.sandbox import Limits, run_many

HARNESS = (Path(__file__).parent / "harness.py").read_text()
log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


@dataclass(frozen=True)
class TestCase:
    __test__ = False  # not a pytest class

    setup: str
    """Code run before the test in a fresh namespace (the test file's imports, helper values)."""
    code: str
    """One statement holding the assert(s), e.g. ``assert candidate(2) == 4``."""


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest class

    passed: bool
    error: str = ""
    """Exception type (``AssertionError``, ``ProgramDied``, ``NotRun`` ...); empty when passed."""
    message: str = ""


@dataclass(frozen=True)
class ExecReport:
    loaded: bool
    """The program's module ran to the end (its definitions exist)."""
    load_error: str
    outcomes: list[TestOutcome] = field(default_factory=list)
    harness_ok: bool = True
    """False when no signed report came back (the harness was killed or timed out)."""
    seconds: float = 0.0

    @property
    def passed_frac(self) -> float:
        return sum(o.passed for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


@dataclass(frozen=True)
class TestLimits:
    """Limits of one program's sandboxed test run: its times, memory, processes and reply size."""

    __test__ = False  # not a pytest class

    load_timeout_s: PositiveFloat = 5.0
    """Time to start the program's process and run its top level (also after a restart)."""
    test_timeout_s: PositiveFloat = 3.0
    """Time for one test's calls into the program (a hung program is restarted for the next test)."""
    budget_s: PositiveFloat = 10.0
    """Time for all tests of one program; tests after it are recorded as not run."""
    memory_mb: PositiveInt = 1024
    """Address space of the harness and of the program, each."""
    processes: PositiveInt = 32
    """Processes and threads of the run's sandbox user (RLIMIT_NPROC): the harness and the program together."""
    max_response_bytes: PositiveInt = 1_000_000
    """Bytes of one reply of the program's process to the harness (a call's result, or its load); past it
    the test fails (the program dies) and the next test gets a fresh process."""

    def __post_init__(self):
        check_dataclass("data.env.test_limits", self)

    @property
    def wall_s(self) -> float:
        """The whole run's limit: a load, the tests' budget, one restart's load and a test's overrun."""
        return self.budget_s + 2 * self.load_timeout_s + self.test_timeout_s + 2.0


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def split_tests(test_source: str, entry_point: str) -> list[TestCase]:
    """One TestCase per top-level statement of ``check``'s body that asserts something about the
    program (it mentions ``candidate`` or the entry point); the statements before it (loops'
    data, imports) become its setup. Asserts that never touch the program (``assert True``) are
    dropped: they would give credit to any program."""
    tree = ast.parse(test_source)
    check = next((s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    module = [s for s in tree.body if s is not check]
    if check is None:  # MBPP style: asserts at the top level
        body, module, param = tree.body, [], "candidate"
    else:
        body, param = check.body, check.args.args[0].arg if check.args.args else "candidate"
    alias = [] if param == "candidate" else [ast.parse(f"{param} = candidate").body[0]]
    tests, prefix = [], []
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        if not has_assert:
            prefix.append(stmt)
        elif _names(stmt) & {param, entry_point}:
            setup = ast.unparse(ast.Module(body=module + alias + prefix, type_ignores=[]))
            tests.append(TestCase(setup=setup, code=ast.unparse(stmt)))
    return tests


def run_tests(
    jobs: list[tuple[str, list[TestCase], str] | tuple[str, list[TestCase], str, str]],
    limits: TestLimits = TestLimits(),
    max_workers: int | None = None,
    isolate: bool | None = None,
) -> list[ExecReport]:
    """``jobs[i] = (program source, its tests, entry point[, provided])``; all run in parallel,
    reports in order. ``provided`` is the task's own code the tests may call besides the entry point
    (the prompt's imports and helpers, see ``CodeEnv.provided``): it runs in the tests' namespace,
    which sees nothing else of the program. ``isolate``: bubblewrap or not (default: where it is
    installed)."""
    jobs = [(*job, "") if len(job) == 3 else tuple(job) for job in jobs]
    nonces = [secrets.token_hex(16) for _ in jobs]
    stdins = [
        json.dumps(
            {
                "nonce": nonce,
                "program": program,
                "tests": [{"setup": t.setup, "code": t.code} for t in tests],
                "entry_point": entry_point,
                "provided": provided,
                "load_timeout_s": limits.load_timeout_s,
                "test_timeout_s": limits.test_timeout_s,
                "budget_s": limits.budget_s,
                "max_response_bytes": limits.max_response_bytes,
            }
        )
        for nonce, (program, tests, entry_point, provided) in zip(nonces, jobs)
    ]
    sandbox = Limits(
        wall_s=limits.wall_s,
        cpu_s=int(limits.wall_s) + 1,
        memory_mb=limits.memory_mb,
        processes=limits.processes,
        # the signed report is the last line: keep all of it (a message of up to 300 characters per test)
        output_chars=20_000 + 400 * max((len(tests) for _, tests, *_ in jobs), default=0),
    )
    results = run_many([HARNESS] * len(jobs), sandbox, max_workers, stdins, isolate)
    reports = []
    for nonce, (_, tests, _, _), result in zip(nonces, jobs, results):
        line = next((ln for ln in result.stdout.splitlines() if ln.startswith(nonce)), None)
        try:
            raw = json.loads(line[len(nonce) :])
            if len(raw["tests"]) != len(tests):
                raise ValueError("a report of another length")
        except (TypeError, ValueError, KeyError):  # no report (the harness died) or a damaged one
            why = "timed out" if result.timed_out else f"exited with {result.returncode}"
            message = f"the harness gave no report ({why}): {result.stderr[-300:]}"
            outcomes = [TestOutcome(False, "NoReport", message)] * len(tests)
            reports.append(ExecReport(False, message, outcomes, harness_ok=False, seconds=result.seconds))
            continue
        if raw["guard"]:
            _warn_once(
                f"the code harness could not forbid forks ({raw['guard']}): a fork bomb is bounded only by "
                "the wall timeout"
            )
        outcomes = [TestOutcome(o["passed"], o["error"], o["message"]) for o in raw["tests"]]
        reports.append(ExecReport(raw["loaded"], raw["load_error"], outcomes, seconds=result.seconds))
    return reports
