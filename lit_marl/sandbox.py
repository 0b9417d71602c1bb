"""Isolated execution of untrusted code (model-written programs and their tests).

Each program runs in a fresh process group under resource limits (CPU seconds, address space,
processes, file size) with a wall-clock timeout that kills the whole group. Where bubblewrap
(`bwrap`, Debian package `bubblewrap`) is available the process also gets no network, a
file system of only the system folders and the interpreter (read-only), a private writable /tmp
and work folder, and an unprivileged user; where it is not, the program
runs with the limits and the timeout in a private temporary folder, and a warning says so once.
Many programs run at once (``run_many``), so a turn's rewards take about as long as the slowest
program, not the sum.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)
_warned_no_bwrap = False


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    """Wall-clock timeout; the whole process group is killed when it passes."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS)."""
    processes: int = 64
    """Processes of the sandbox user (RLIMIT_NPROC)."""
    file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    output_chars: int = 20_000
    """Characters of stdout/stderr kept."""


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None: killed by the wall timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    isolated: bool  # ran under bubblewrap

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def bubblewrap_available() -> bool:
    return shutil.which("bwrap") is not None


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    os.setsid()
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # the kernel does not apply RLIMIT_NPROC to root's processes, even as a mapped user under bwrap;
    # the code harness therefore also forbids its candidate to fork (a seccomp filter)
    if os.getuid() != 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def _command(code_path: str, workdir: str, isolate: bool, limits: Limits) -> list[str]:
    # the real interpreter, not a venv's link to it: the sandbox needs no site-packages, and a venv
    # inside /tmp would be hidden by the sandbox's private /tmp
    python = [os.path.realpath(sys.executable), "-I", "-B", code_path]
    if not isolate:
        return python
    # only the system's programs and libraries and the interpreter are visible (read-only): not the
    # home folders, the checkout or the data, which the sandbox user could otherwise read (when the
    # trainer runs as root, root's files belong to the sandbox's mapped user)
    system = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr"):
        if os.path.islink(top):
            system += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            system += ["--ro-bind", top, top]
    base = os.path.realpath(sys.base_prefix)
    if not base.startswith("/usr/"):
        system += ["--ro-bind", base, base]
    # the limits are applied to bwrap itself and inherited; NPROC is set inside for the sandbox user
    return [
        "bwrap",
        *system,
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--bind", workdir, workdir,
        "--remount-ro", "/",
        "--chdir", workdir,
        "--unshare-all",
        "--unshare-user",
        "--uid", "65534",
        "--gid", "65534",
        "--die-with-parent",
        "--new-session",
        "--",
        "/bin/sh", "-c", f'ulimit -u {limits.processes} 2>/dev/null; exec "$@"', "sh",
        *python,
    ]  # fmt: skip


def run_python(code: str, limits: Limits = Limits(), isolate: bool | None = None, stdin: str = "") -> Result:
    """Run ``code`` with ``python -I`` in a sandbox, ``stdin`` on its standard input; never raises for
    anything the program does."""
    global _warned_no_bwrap
    if isolate is None:
        isolate = bubblewrap_available()
        if not isolate and not _warned_no_bwrap:
            _warned_no_bwrap = True
            log.warning(
                "bubblewrap (bwrap) not found: untrusted code runs with resource limits and a timeout "
                "but with network access and the host's file system. Install the Debian package "
                "'bubblewrap' for isolation."
            )
    with tempfile.TemporaryDirectory(prefix="lit_marl_sandbox-") as workdir:
        os.chmod(workdir, 0o777)  # the sandbox user may write its own files
        code_path = os.path.join(workdir, "program.py")
        with open(code_path, "w") as f:
            f.write(code)
        start = time.perf_counter()
        proc = subprocess.Popen(
            _command(code_path, workdir, isolate, limits),
            cwd=workdir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _set_limits(limits),
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"},
        )
        timed_out = False
        try:
            stdout, stderr = proc.communicate(stdin.encode(), timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: children and grandchildren
            except ProcessLookupError:
                pass
            stdout, stderr = proc.communicate()
        seconds = time.perf_counter() - start
    cut = limits.output_chars
    return Result(
        returncode=None if timed_out else proc.returncode,
        stdout=stdout.decode(errors="replace")[:cut],
        stderr=stderr.decode(errors="replace")[:cut],
        timed_out=timed_out,
        seconds=seconds,
        isolated=isolate,
    )


def run_many(
    programs: list[str],
    limits: Limits = Limits(),
    max_workers: int | None = None,
    stdins: list[str] | None = None,
    isolate: bool | None = None,
) -> list[Result]:
    """Run programs in parallel (bounded), results in input order; ``stdins[i]`` feeds program i."""
    workers = max_workers or min(len(programs), 2 * (os.cpu_count() or 1)) or 1
    stdins = stdins if stdins is not None else [""] * len(programs)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_python(job[0], limits, isolate, job[1]), zip(programs, stdins)))
