"""Runs listed pytest tests and reports each one's outcome (this file runs INSIDE the sandbox).

Usage: ``python -I -B runner.py <the tools' site folder> <workspace> <report chars> <seconds per test>
[pytest args...]``; stdin holds a first line with a key (hex) and a second with JSON
``{"tests": [node ids], "changed": [workspace paths the agent wrote]}``.

The code under test runs in this process, so nothing it can reach decides the score:

- **The verdict is kept where Python objects cannot reach it.** An audit hook (``sys.addaudithook``:
  it cannot be removed for the life of the process) is a ``functools.partial`` over one namespace of
  state (``harness.py``: no class anywhere, so ``object.__subclasses__()`` leads nowhere; the garbage
  collector is refused to everyone, frames while the harness runs). Each test's outcome is what the
  runner's own ``pytest_runtest_call`` wrapper sees the test function do (return, or raise), handed
  to the hook by that wrapper's code only (the hook checks the calling code object, the thread, that
  no untrusted code is on the stack, and that each test is reported once).
- **Outcomes leave as they are decided**: one line per event on the report's descriptor,
  ``<hmac> <seq> <kind> <hex fields>``, signed with the run's key by C functions captured before any
  code of the workspace ran; the trainer takes lines 0, 1, 2, ... to ``finish`` and nothing else.
- **Tripwires.** Untrusted code (in a changed file the module's code and the functions whose lines
  take in a changed line, the files the agent added, anything compiled at run time, any file outside
  the standard library, the tools' site folder and the repository; in a thread the runner did not
  start, the thread's own start) that reads frames, builds code or function objects, loads
  ``ctypes``, starts processes, sends signals, installs signal handlers, opens the test files or
  ``/proc``, swaps a function's code, or reads the code of a test function, is refused (the call
  raises) and the run is *tampered*: every listed test fails. Walking the garbage collector, tracing
  and adding audit hooks are refused to everyone.
- **Comparisons** (``harness_checks.py``): a class's ``__eq__``/``__ne__`` that is not the libraries'
  is wrapped and asked about values it cannot know alongside each real question; assertions check
  their operands the same way.
- **Integrity.** pytest's, pluggy's and unittest's module and class attributes, pytest's plugins and
  hook implementations, the signal handlers and the harness's wrappers are compared with a snapshot
  taken before any code of the workspace ran, at the end of every test; every module loaded before
  the workspace joined ``sys.path`` (the standard library included) at the end of the run.
- File descriptors 1 and 2 go to a log before anything runs; pytest's entry-point plugins are not
  autoloaded; every ``-packages`` folder is dropped from ``sys.path`` and the tools' site folder
  (pytest and what it requires) put first; a test that runs longer than its seconds fails (SIGALRM).
"""

import json
import os
import signal
import sys
import types


def _load_harness():
    """The audit hook's builder of the ``harness*.py`` files beside this file, run in a
    namespace of their own with a private copy of the builtins (not a module, no class: nothing the code
    under test reaches leads to it)."""
    import builtins

    folder = os.path.dirname(os.path.realpath(__file__))
    files = tuple(os.path.join(folder, name) for name in ("harness.py", "harness_checks.py", "harness_equality.py"))
    namespace = {"__name__": "lit_marl_harness", "__file__": files[0], "HARNESS_FILES": files,
                 "__builtins__": dict(builtins.__dict__)}  # fmt: skip
    for path in files:
        with open(path) as handle:
            exec(compile(handle.read(), path, "exec"), namespace)
    return namespace["build"]


def _guarded(self, name, audit=sys.audit, get=object.__getattribute__):
    """``__getattribute__`` of a guarded object: untrusted code reading its attributes is refused
    (what it calls is bound as defaults: setting ``__defaults__`` is itself refused)."""
    audit("lit_marl.module", name)
    return get(self, name)


def _guarded_module(self, name, audit=sys.audit, get=types.ModuleType.__getattribute__):
    audit("lit_marl.module", name)
    return get(self, name)


class Guarded(types.ModuleType):
    """A test module once collected (and pytest's assertion helpers, which hold the current config
    and item): untrusted code reading its attributes (the tests, their marks and parameters, the
    module's data) is refused."""

    __getattribute__ = _guarded_module


def main():
    site, workspace, keep, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    errors = os.fdopen(os.dup(2), "w")
    try:
        run(*read_input(), site, workspace, keep, seconds)
    except BaseException:  # the harness's own failure, before any report: its traceback on stderr
        import traceback

        errors.write(traceback.format_exc())
        errors.flush()
        os._exit(3)


def read_input() -> tuple[bytes, dict]:
    """The key and the spec, read from descriptor 0 to its end (nothing stays in a buffer), which then
    reads /dev/null."""
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)  # descriptor 0 stays taken: the report's descriptor is never 0,
    os.dup2(null, 0)  # which pytest's capture of stdin replaces while the tests run
    os.close(null)
    head, _, rest = b"".join(chunks).partition(b"\n")
    return bytes.fromhex(head.decode()), json.loads(rest)


def prepare(site: str) -> None:
    """sys.path: the standard library, then the venv's site-packages (never the base interpreter's);
    pytest and everything the verdict depends on imported before any code of the workspace."""
    sys.path[:] = [p for p in sys.path if "-packages" not in p]
    sys.path.insert(0, site)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ.pop("PYTEST_ADDOPTS", None)
    os.environ.pop("PYTEST_PLUGINS", None)
    import inspect  # noqa: F401
    import logging  # noqa: F401
    import traceback  # noqa: F401
    import unittest  # noqa: F401
    import unittest.mock  # noqa: F401

    import _pytest.main  # noqa: F401
    import _pytest.python  # noqa: F401
    import _pytest.reports  # noqa: F401
    import _pytest.runner  # noqa: F401
    import pytest  # noqa: F401


def run(key: bytes, spec: dict, site: str, workspace: str, keep: int, seconds: float) -> None:
    report = os.dup(1)
    log_path = os.path.join("/tmp", f"lit_marl_pytest-{os.getpid()}.log")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    prepare(site)
    import pytest

    wanted = list(spec["tests"])
    plugin = make_plugin(wanted, seconds)
    workspace = os.path.realpath(workspace)
    base = {os.path.join(workspace, p) for p in _walk(workspace)} - {
        os.path.join(workspace, p) for p in spec["changed"]
    }
    install(key, report, plugin, workspace, frozenset(base), [os.path.realpath(site)], spec)
    del key, spec
    sys.audit("lit_marl.note", f"pytest {pytest.__version__} {os.path.dirname(pytest.__file__)}")
    sys.path.insert(0, workspace)
    os.chdir(workspace)
    files = sorted({test.split("::", 1)[0] for test in wanted})
    args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o", "enable_assertion_pass_hook=true",
            "--rootdir", workspace, *sys.argv[5:], *files]  # fmt: skip
    try:
        code = int(pytest.main(args, plugins=[plugin]))
    except BaseException as err:  # a test that exits the process
        code = -1
        sys.audit("lit_marl.note", f"pytest raised {type(err).__name__}")
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, errors="replace") as handle:
        text = handle.read()
    sys.audit("lit_marl.finish", code, text[-keep:])
    os._exit(0)  # no atexit handler of the tests' code runs after the report


def _walk(root: str) -> list[str]:
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        out += [os.path.relpath(os.path.join(folder, name), root) for name in names]
    return out


def make_plugin(wanted: list[str], seconds: float):
    """The runner's pytest plugin: keeps the listed tests, times each one, calls each test function
    itself (pytest's ``pytest_pyfunc_call``, first: no other implementation runs) and hands each test's
    own outcome (what the test function did: return, or raise) to the audit hook."""
    import pytest
    from _pytest.python import async_fail, is_async_function

    wanted = set(wanted)

    def too_long(signum, frame):
        raise TimeoutError(f"the test ran longer than {seconds:g} s")

    class Record:
        def pytest_collection_modifyitems(self, session, config, items):
            keep_items = [item for item in items if item.nodeid in wanted]
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
            items[:] = keep_items

        def pytest_collection_finish(self, session):
            sys.audit("lit_marl.collected", session)

        @pytest.hookimpl(wrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item):
            sys.audit("lit_marl.enter", item)
            signal.signal(signal.SIGALRM, too_long)
            signal.setitimer(signal.ITIMER_REAL, seconds)
            raised = True
            try:
                yield
                raised = bool(item.__dict__.get("_excinfo"))  # a unittest test reports its failure, not raises
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                sys.audit("lit_marl.outcome", item, "failed" if raised else "passed")

        @pytest.hookimpl(tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem):  # the test function is called here, by the runner's own code
            sys.audit("lit_marl.calling", pyfuncitem)
            testfunction = pyfuncitem.obj
            if is_async_function(testfunction):
                async_fail(pyfuncitem.nodeid)
            funcargs = pyfuncitem.funcargs
            result = testfunction(**{arg: funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames})
            if hasattr(result, "__await__") or hasattr(result, "__aiter__"):
                async_fail(pyfuncitem.nodeid)
            return True

        def pytest_assertrepr_compare(self, config, op, left, right):  # also for assertions that pass
            sys.audit("lit_marl.compared", op, left, right)

        def pytest_assertion_pass(self, item, lineno, orig, expl):  # (so that passing ones are explained)
            pass

        def pytest_runtest_logreport(self, report):  # a failing subtest fails its test (it only can fail one)
            if report.failed:
                sys.audit("lit_marl.failed", report.nodeid)

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_teardown(self, item):
            yield
            sys.audit("lit_marl.check", item)

    return Record()


def install(key, report_fd, plugin, workspace, base, roots, spec) -> None:
    """The audit hook (see the module's docstring): a partial of a function no object refers to, over a
    state nothing else holds."""
    import _signal

    real_signal = _signal.signal

    def guarded_signal(signalnum, handler):  # holds nothing but the real function
        sys.audit("lit_marl.signal")
        return real_signal(signalnum, handler)

    _signal.signal = guarded_signal  # signal.signal calls it too
    record = type(plugin)
    codes = {
        "outcome": record.pytest_runtest_call.__code__, "enter": record.pytest_runtest_call.__code__,
        "check": record.pytest_runtest_teardown.__code__, "failed": record.pytest_runtest_logreport.__code__,
        "collected": record.pytest_collection_finish.__code__, "calling": record.pytest_pyfunc_call.__code__,
        "finish": run.__code__, "note": run.__code__,
    }  # fmt: skip
    sys.addaudithook(_load_harness()(key, report_fd, codes, (Guarded, _guarded), workspace, base, roots, spec))


if __name__ == "__main__":
    main()
