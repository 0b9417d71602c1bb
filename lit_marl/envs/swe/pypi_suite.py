"""Running a PyPI project's test suite for the instance set (``pypi_set.py``) and searching it for
mutants that make good instances.

The suite runs as scoring runs it (no ``addopts``, the project folder as pytest's root) with a probe
plugin (``pypi_probe.py``) that reports each test's outcome and crash line and, once, which source
lines the tests reach. ``green_suite`` drops test files that do not collect and removes tests that
fail on the released code; ``search`` tries seeded mutations of reached lines one at a time, each
with the whole suite, and keeps those that break 1 to ``max_fail`` tests, then a few pairs of them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lit_marl.envs.swe import instances, scoring
from lit_marl.envs.swe.pypi_mutations import Mutation, mutations, parses, remove_tests, split_lines

PROBE = Path(__file__).with_name("pypi_probe.py")


class BuildError(RuntimeError):
    """A project that cannot become instances (no tests, a suite that does not finish, ...)."""


@dataclass(frozen=True)
class BuildSettings:
    """How many mutants each project tries and keeps, and what an instance may hold."""

    seed: int = 0
    max_tried: int = 90
    """Single mutants run per project (each one: the whole suite)."""
    max_kept: int = 24
    """Single-mutation instances per project."""
    doubles: int = 2
    """Two-mutation instances per project (two kept mutants together)."""
    max_fail: int = 10
    """Most tests a mutant may break (FAIL_TO_PASS); one that breaks more is dropped."""
    max_p2p: int = 20
    """PASS_TO_PASS tests sampled per instance, from the FAIL_TO_PASS tests' files first."""
    per_function: int = 2
    """Instances whose mutation is in one function."""
    run_timeout_s: float = 120.0
    """Longest suite run; a mutant's run takes at most 10 s plus 3 times the unmutated suite's time."""


@dataclass
class Suite:
    tests: dict[str, tuple[str, str]]
    """Each test: its outcome (``passed``, ``failed``, ``skipped``) and, when it failed, its crash line."""
    errors: list[str]
    """Files (node ids) that failed to collect."""
    lines: set[tuple[str, int]] = field(default_factory=set)
    seconds: float = 0.0

    def failing(self) -> list[str]:
        return sorted(t for t, (outcome, _) in self.tests.items() if outcome == "failed")


def source_files(files: dict[str, bytes]) -> list[str]:
    """The files mutations may touch: the package's Python files that are not test code."""
    return [p for p in files if p.endswith(".py") and not instances.is_test_path(p, [])]


# --------------------------------------------------------------------------- running the suite
def run_suite(folder: Path, timeout: float, trace: list[str] = ()) -> Suite | None:
    """The project's whole suite in ``folder`` (as scoring runs it: no addopts, ``folder`` as the
    root; no bytecode written, plugins not autoloaded); None when it does not finish in ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="swe-pypi-probe-") as tmp:
        shutil.copy(PROBE, Path(tmp) / "_swe_probe.py")
        report = Path(tmp) / "report.json"
        env = {
            **os.environ,
            "PYTHONPATH": tmp,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "SWE_PROBE_OUT": str(report),
            "SWE_PROBE_TRACE": os.pathsep.join(trace),
        }
        options = "-q -p no:cacheprovider -p _swe_probe -o addopts=".split()
        argv = [sys.executable, "-m", "pytest", *options, "--rootdir", str(folder)]
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        finally:
            try:  # whatever the tests left running in the group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not report.is_file():
            return None
        data = json.loads(report.read_text())
    tests = {test: (outcome, message) for test, (outcome, message) in data["tests"].items()}
    lines = {(path, line) for path, line in data["lines"]}
    return Suite(tests, list(data["errors"]), lines, time.monotonic() - start)


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)


def green_suite(folder: Path, files: dict[str, bytes], settings: BuildSettings) -> tuple[dict[str, bytes], Suite]:
    """``files`` (written in ``folder``) made green: test files that do not collect are dropped, tests
    that fail are removed; the files and the suite's traced run (all source files traced)."""
    files = dict(files)
    write_files(folder, files)
    trace = [str(folder / p) for p in source_files(files)]
    for _ in range(3):
        suite = run_suite(folder, settings.run_timeout_s, trace)
        if suite is None:
            raise BuildError(f"the test suite gives no report within {settings.run_timeout_s:g} s")
        failing = suite.failing()
        if not suite.errors and not failing:
            if not suite.tests:
                raise BuildError("pytest collects no tests")
            return files, suite
        for path in suite.errors:
            if path not in files:
                raise BuildError(f"pytest cannot collect {path or 'the tests'} (a conftest that does not import?)")
            del files[path]
            (folder / path).unlink()
        for path in sorted({t.split("::", 1)[0] for t in failing} - set(suite.errors)):
            names = [t.split("[", 1)[0].split("::", 1)[1] for t in failing if t.startswith(path + "::")]
            try:
                files[path] = remove_tests(files[path].decode(), names).encode()
                write_files(folder, {path: files[path]})
            except ValueError:
                del files[path]
                (folder / path).unlink()
    raise BuildError(f"the suite is still not green after removing failing tests: {suite.failing()[:5]}")


# --------------------------------------------------------------------------- searching for mutants
def candidates(files: dict[str, bytes], suite: Suite, folder: Path, project: str, seed: int) -> list[Mutation]:
    """Every mutation of a source line the suite runs, in a seeded order that visits each function
    once before any function a second time, the operators in turn."""
    tamper = getattr(scoring, "TAMPER", None)  # a line the scorer refuses to see added back is no fix
    found = []
    for path in source_files(files):
        real, text = os.path.realpath(folder / path), files[path].decode(errors="replace")
        lines = split_lines(text)
        reached = {n for p, n in suite.lines if p == real and not (tamper and tamper.search(lines[n - 1]))}
        found += mutations(text, path, lines=reached, check=False)  # checked when tried
    rng = random.Random(f"{seed}:{project}")
    rng.shuffle(found)
    seen: dict[tuple[str, str], int] = {}
    ranked = []
    for i, mutation in enumerate(found):
        key, operator = (mutation.path, mutation.function), ("", mutation.operator)
        seen[key], seen[operator] = seen.get(key, 0) + 1, seen.get(operator, 0) + 1
        ranked.append((seen[key], seen[operator], i, mutation))
    return [r[-1] for r in sorted(ranked, key=lambda r: r[:3])]


@dataclass
class Kept:
    mutations: tuple[Mutation, ...]
    fail: list[str]
    messages: dict[str, str]
    passing: list[str]


def try_mutants(
    folder: Path, files: dict[str, bytes], mutants: tuple[Mutation, ...], base: Suite, timeout: float, max_fail: int
) -> Kept | str:
    """Run the suite with ``mutants`` applied; the instance they make, or why there is none."""
    changed = {}
    for mutation in sorted(mutants, key=lambda m: (m.path, -m.line, -m.start)):
        changed[mutation.path] = mutation.apply(changed.get(mutation.path, files[mutation.path].decode()))
    write_files(folder, {p: t.encode() for p, t in changed.items()})
    try:
        suite = run_suite(folder, timeout)
    finally:
        write_files(folder, {p: files[p] for p in changed})
    if suite is None:
        return "timeout"
    if suite.errors:
        return "collection error"
    fail = [t for t in suite.failing() if base.tests.get(t, ("",))[0] == "passed"]
    if not fail:
        return "survived"
    if len(fail) > max_fail:
        return "too many failures"
    broken = {t.split("[", 1)[0] for t in fail}
    passing = [t for t, (o, _) in sorted(suite.tests.items()) if o == "passed" and t.split("[", 1)[0] not in broken]
    return Kept(mutants, fail, {t: suite.tests[t][1] for t in fail}, passing)


def search(folder: Path, files: dict[str, bytes], base: Suite, project: str, settings: BuildSettings, log=None):
    """The kept mutants (singles, then a few pairs) and the reasons the others were dropped."""
    untraced = run_suite(folder, settings.run_timeout_s)  # the traced run is slower: the timeout from this one
    timeout = min(settings.run_timeout_s, 10 + 3 * (untraced.seconds if untraced else base.seconds))
    kept: list[Kept] = []
    reasons: dict[str, int] = {}
    per_function: dict[tuple[str, str], int] = {}
    tried = 0
    for mutation in candidates(files, base, folder, project, settings.seed):
        if tried >= settings.max_tried or len(kept) >= settings.max_kept:
            break
        key = (mutation.path, mutation.function)
        if per_function.get(key, 0) >= settings.per_function or not parses(mutation, files[mutation.path].decode()):
            continue
        tried += 1
        outcome = try_mutants(folder, files, (mutation,), base, timeout, settings.max_fail)
        if isinstance(outcome, str):
            reasons[outcome] = reasons.get(outcome, 0) + 1
            continue
        kept.append(outcome)
        per_function[key] = per_function.get(key, 0) + 1
        if log:
            log(f"  {project}: kept {len(kept)} of {tried} ({mutation.operator} in {mutation.path}:{mutation.line})")
    singles = list(kept)
    pairs = sorted(
        (
            (a.mutations[0].path == b.mutations[0].path, i + j, i, j)
            for i, a in enumerate(singles)
            for j, b in enumerate(singles[i + 1 :], i + 1)
            if a.mutations[0].function != b.mutations[0].function
            and not {t.split("[", 1)[0] for t in a.fail} & {t.split("[", 1)[0] for t in b.fail}
        ),
    )
    made, used = 0, set()
    for *_, i, j in pairs:
        if made >= settings.doubles or tried >= settings.max_tried + 3 * settings.doubles:
            break
        if i in used or j in used:
            continue
        a, b = singles[i], singles[j]
        outcome = try_mutants(folder, files, a.mutations + b.mutations, base, timeout, 2 * settings.max_fail)
        tried += 1
        if isinstance(outcome, Kept) and set(outcome.fail) == set(a.fail) | set(b.fail):
            kept.append(outcome)
            made += 1
            used |= {i, j}
    return kept, tried, reasons
