"""A pytest plugin of the PyPI set builder (``pypi_set.run_suite`` loads it with ``-p _swe_probe``):
each test's outcome (a failure in any phase fails it) and its crash line, the files that did not
collect and, when ``SWE_PROBE_TRACE`` lists source files, the lines of them that ran; written as
JSON to ``SWE_PROBE_OUT`` at the end of the session."""

import json
import os
import sys
import threading

_tests, _errors, _lines = {}, [], set()
_trace = {os.path.realpath(p) for p in os.environ.get("SWE_PROBE_TRACE", "").split(os.pathsep) if p}
_known = {}


def _local(frame, event, arg):
    if event == "line":
        _lines.add((frame.f_code.co_filename, frame.f_lineno))
    return _local


def _global(frame, event, arg):
    name = frame.f_code.co_filename
    traced = _known.get(name)
    if traced is None:
        traced = _known[name] = os.path.realpath(name) in _trace
    return _local if traced else None


if _trace:
    sys.settrace(_global)
    threading.settrace(_global)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if _tests.get(report.nodeid, ("passed", ""))[0] == "passed":
            crash = getattr(report.longrepr, "reprcrash", None)
            text = (crash.message if crash is not None else str(report.longrepr or "")).strip()
            _tests[report.nodeid] = (report.outcome, text.splitlines()[0][:300] if report.failed and text else "")


def pytest_collectreport(report):
    if report.failed:
        _errors.append(report.nodeid)


def pytest_sessionfinish(session):
    sys.settrace(None)
    threading.settrace(None)
    real = {name: os.path.realpath(name) for name in {name for name, _ in _lines}}
    lines = sorted((real[name], line) for name, line in _lines)
    with open(os.environ["SWE_PROBE_OUT"], "w") as handle:
        json.dump({"tests": _tests, "errors": _errors, "lines": lines}, handle)
