"""Runs scripts as ``python SCRIPT ARGS`` would, each in its own process, without importing torch,
Lightning, transformers and lit_marl again for each (4-5 CPU seconds a script on the test machine):
this process imports them once, then forks a child per script, which runs it as ``__main__`` with
its own argv, working folder and output files. Used by tests/invariant/test_bench_scripts.py.

Reads one job per line on stdin, a JSON object ``{"script", "args", "cwd", "out", "timeout"}``; the
child writes its output to ``OUT.stdout`` and ``OUT.stderr``; when it ends this process answers one
line on stdout, ``{"returncode": N, "seconds": S}`` (-9: killed at its timeout). Jobs run one at a
time. The libraries are imported before any thread starts, so forking is safe.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import time
import traceback

import lightning  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import lit_marl.agents  # noqa: F401
import lit_marl.algorithms  # noqa: F401
import lit_marl.data  # noqa: F401
import lit_marl.generation  # noqa: F401


def child(job: dict) -> int:
    """Runs in the forked child: the script as __main__; its exit status."""
    os.setpgid(0, 0)  # its own process group: a timeout kills what it started too
    os.chdir(job["cwd"])
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        target = os.open(f"{job['out']}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [job["script"], *job["args"]]
    sys.path.insert(0, os.path.dirname(job["script"]))  # as `python SCRIPT` puts the script's folder first
    try:
        runpy.run_path(job["script"], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # sys.exit("message"): printed, status 1
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def run(job: dict) -> dict:
    start = time.perf_counter()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(job)
        finally:
            os._exit(code)
    deadline = start + job["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status), "seconds": time.perf_counter() - start}
        if time.perf_counter() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"returncode": -9, "seconds": time.perf_counter() - start}
        time.sleep(0.02)


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
