"""Runs listed pytest tests and reports each one's outcome (this file runs INSIDE the sandbox).

Usage: ``python -I -B runner.py <pytest's site folder> <workspace> <report chars> <seconds per test>
[pytest args...]``,
the test ids (pytest node ids) one per line on stdin after a first line holding a nonce. Before any
code of the workspace is imported, the real stdout is kept and file descriptors 1 and 2 point to a
log file, so whatever the tests or the code print never reaches the report; the report is one line
on the kept stdout, ``<nonce> <json>``: ``{"outcomes": {test id: "passed" | "failed" | ...},
"exit": pytest's exit code, "log": the log's tail}``. Only the listed tests run (the others are
deselected); a listed test that pytest does not collect is absent from the outcomes; a test that
runs longer than its seconds fails (SIGALRM). pytest and its plugins are imported before the
workspace joins ``sys.path``, so no file of the workspace can stand in for them.
"""

import json
import os
import signal
import sys


def main():
    site, workspace, keep, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    lines = sys.stdin.read().splitlines()
    nonce, wanted = lines[0], [line for line in lines[1:] if line.strip()]
    report, errors = os.fdopen(os.dup(1), "w"), os.fdopen(os.dup(2), "w")
    try:
        run(nonce, wanted, site, workspace, keep, seconds, report)
    except BaseException:  # the harness's own failure, before any report: its traceback on stderr
        import traceback

        errors.write(traceback.format_exc())
        errors.flush()
        os._exit(3)


def run(nonce, wanted, site, workspace, keep, seconds, report):
    log_path = os.path.join("/tmp", f"lit_marl_pytest-{os.getpid()}.log")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.path.append(site)
    import _pytest.main  # noqa: F401
    import _pytest.reports  # noqa: F401
    import _pytest.runner  # noqa: F401
    import pytest

    sys.path.insert(0, workspace)
    os.chdir(workspace)

    def too_long(signum, frame):
        raise TimeoutError(f"the test ran longer than {seconds:g} s")

    outcomes = {}

    class Record:
        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(self, session, config, items):
            keep_items = [item for item in items if item.nodeid in set(wanted)]
            config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in set(wanted)])
            items[:] = keep_items

        @pytest.hookimpl(wrapper=True)
        def pytest_runtest_call(self, item):
            signal.signal(signal.SIGALRM, too_long)
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                return (yield)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                previous = outcomes.get(report.nodeid, "passed")
                outcomes[report.nodeid] = report.outcome if previous == "passed" else previous

    files = sorted({test.split("::", 1)[0] for test in wanted})
    args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", workspace, *sys.argv[5:], *files]
    try:
        code = int(pytest.main(args, plugins=[Record()]))
    except BaseException as err:  # a test that exits the process
        code = -1
        outcomes.setdefault("<runner>", f"{type(err).__name__}")
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, errors="replace") as handle:
        text = handle.read()
    report.write(nonce + " " + json.dumps({"outcomes": outcomes, "exit": code, "log": text[-keep:]}) + "\n")
    report.flush()
    os._exit(0)  # no atexit handler of the tests' code runs after the report


if __name__ == "__main__":
    main()
