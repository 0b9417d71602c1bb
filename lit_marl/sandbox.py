"""Isolated execution of untrusted code (model-written programs and their tests).

Each program runs in a fresh process group under resource limits (CPU seconds, address space,
processes, file size) with a wall-clock timeout that kills the whole group, and its output is read
as it comes with a hard cap (a program that writes more is stopped: the trainer's memory never
holds more than the cap). Where bubblewrap (`bwrap`, Debian package `bubblewrap`) is available the
process also gets its own PID, network, IPC and UTS namespaces (no network; it cannot see or signal
the trainer), a file system of only the system folders and the interpreter (read-only), one
writable folder (`/tmp`, the work folder: a tmpfs of at most ``disk_mb``) and an unprivileged user:
when the trainer runs as root, a host uid of its own per concurrent program (root is exempt from
RLIMIT_NPROC, also when mapped to another user in a user namespace, so the program must not be
root on the host); otherwise the trainer's user mapped to 65534 in a user namespace. Where
bubblewrap is not installed the program runs with the limits and the timeout in a private
temporary folder, and a warning says so once. Many programs run at once (``run_many``), so a turn's
rewards take about as long as the slowest program, not the sum.
"""

from __future__ import annotations

import glob
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lit_marl.fields import PositiveFloat, PositiveInt, check_dataclass

log = logging.getLogger(__name__)
_warned_no_bwrap = False
_warned_no_setpriv = False
_CHUNK = 1 << 16

# host uids for sandboxed programs when the trainer is root: one per program running at once, so the
# process limit of one is not spent by another's; offset by the trainer's pid so that ranks on one
# host (each its own process) use different uids
_UID_BASE = 200_000 + (os.getpid() % 2048) * 256
_uids_lock = threading.Lock()
_uids_in_use: set[int] = set()


@dataclass(frozen=True)
class Limits:
    wall_s: PositiveFloat = 10.0
    """Wall-clock timeout; the whole process group is killed when it passes."""
    cpu_s: PositiveInt = 10
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: PositiveInt = 1024
    """Address space (RLIMIT_AS)."""
    processes: PositiveInt = 64
    """Processes and threads of the sandbox user (RLIMIT_NPROC)."""
    file_mb: PositiveInt = 16
    """Largest file the program may write (RLIMIT_FSIZE)."""
    disk_mb: PositiveInt = 64
    """Everything the program may write, in total (with bubblewrap: the size of its one writable
    folder, a tmpfs, which is host memory that ``memory_mb`` does not count)."""
    output_chars: PositiveInt = 20_000
    """Characters of stdout/stderr kept (each)."""
    output_mb: PositiveFloat = 8.0
    """Hard cap on what the program writes to stdout and stderr together: past it the program is
    stopped (``Result.output_overflow``); the trainer never buffers more than ``output_chars``."""

    def __post_init__(self):
        check_dataclass("sandbox Limits", self)


@dataclass(frozen=True)
class Result:
    returncode: int | None  # None: killed by the wall timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    isolated: bool  # ran under bubblewrap
    output_overflow: bool = False  # stopped for writing more than Limits.output_mb

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_overflow


def bubblewrap_available() -> bool:
    return shutil.which("bwrap") is not None


def _setpriv_available() -> bool:
    global _warned_no_setpriv
    if shutil.which("setpriv"):
        return True
    if not _warned_no_setpriv:
        _warned_no_setpriv = True
        log.warning(
            "setpriv (util-linux) not found: sandboxed programs of this root trainer run as root mapped to "
            "65534, where RLIMIT_NPROC does not bind (the code harness's seccomp filter still stops forks)"
        )
    return False


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    os.setsid()
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    file_bytes = min(limits.file_mb, limits.disk_mb) * mb
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # inherited; it binds once the program runs as a non-root uid (root's own processes are exempt)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def _take_uid() -> int:
    with _uids_lock:
        uid = next(u for u in range(_UID_BASE, _UID_BASE + 10_000) if u not in _uids_in_use)
        _uids_in_use.add(uid)
        return uid


def _give_uid(uid: int | None) -> None:
    with _uids_lock:
        _uids_in_use.discard(uid)


def installed_package_folders() -> list[str]:
    """The interpreters' own package folders (``site-packages``, ``dist-packages``) under the folders a
    sandbox sees (``/usr``, the base interpreter's): inside, an empty folder stands in for each, so a
    program sees only the packages it is given (``read_only``), never what the host has installed."""
    base = os.path.realpath(sys.base_prefix)
    patterns = [f"{top}/lib/python3*/{kind}" for top in ("/usr", "/usr/local", base) for kind in ("site-packages",
                "dist-packages")] + ["/usr/lib/python3/dist-packages"]  # fmt: skip
    return sorted({os.path.realpath(p) for pattern in patterns for p in glob.glob(pattern) if os.path.isdir(p)})


_empty: list[str] = []


def _empty_folder() -> str:
    if not _empty:
        _empty.append(tempfile.mkdtemp(prefix="lit_marl_empty-"))
        os.chmod(_empty[0], 0o755)
    return _empty[0]


def _parents(path: str) -> list[str]:
    """``path``'s folders below ``/``, outermost first."""
    parents, parent = [], os.path.dirname(path)
    while parent != "/":
        parents.insert(0, parent)
        parent = os.path.dirname(parent)
    return parents


def _command(
    argv: list[str],
    isolate: bool,
    limits: Limits,
    uid: int | None,
    read_only: list[tuple[str, str]],
    writable: str | None = None,
) -> list[str]:
    """The command line: ``argv`` as it is without bubblewrap; with it, inside a file system of the
    system's folders, the interpreter and each ``(host path, path inside)`` of ``read_only``, with
    one writable ``/tmp`` (a tmpfs of ``disk_mb``) and, when given, the host folder ``writable``
    bound read-write at its own path (a workspace) and made the working folder."""
    if not isolate:
        return list(argv)
    # only the system's programs and libraries and the interpreter are visible (read-only): not the
    # home folders, the checkout or the data
    system = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/usr"):
        if os.path.islink(top):
            system += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            system += ["--ro-bind", top, top]
    base = os.path.realpath(sys.base_prefix)
    extra = ([] if base.startswith("/usr/") else [(base, base)]) + list(read_only)
    empty = _empty_folder()
    extra += [(empty, folder) for folder in installed_package_folders() if folder not in {i for _, i in read_only}]
    made: set[str] = {"/tmp"}
    binds = []  # after /tmp's tmpfs, so that folders made inside it are not hidden by it
    for host, inside, how in [(h, i, "--ro-bind") for h, i in extra] + (
        [(writable, writable, "--bind")] if writable else []
    ):
        for folder in _parents(inside):  # traversable by the sandbox user (e.g. /root is 0700 on the host)
            if folder not in made:
                made.add(folder)
                (binds if folder.startswith("/tmp/") else system).extend(["--perms", "0755", "--dir", folder])
        binds += [how, host, inside]
    work = ["--chdir", writable] if writable else ["--chdir", "/tmp"]
    if uid is not None:  # the trainer is root: bwrap as root, the program as its own host uid
        user = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        user += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        drop = [
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip
    else:  # an unprivileged trainer: a user namespace, the trainer's user mapped to 65534
        user = ["--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534"]
        drop = []
    return [
        "bwrap",
        *system,
        "--dev", "/dev",
        "--proc", "/proc",
        "--perms", "1777", "--size", str(limits.disk_mb * 1024 * 1024), "--tmpfs", "/tmp",
        *binds,
        *work,
        "--remount-ro", "/",
        *user,
        "--die-with-parent",
        "--new-session",
        "--",
        *drop,
        *argv,
    ]  # fmt: skip


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the program's process group, and the process itself should it have left the group
    (only while it is not yet reaped: its pid could belong to another process afterwards)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()


def _exchange(proc: subprocess.Popen, data: bytes, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """Feed ``data`` to stdin and read stdout and stderr as they come, until the program exits, the
    wall time passes or the output passes its cap; at most ``4 * output_chars`` bytes of each are
    kept. Never waits past the deadline, also when a process that escaped the group holds a pipe."""
    deadline = time.monotonic() + limits.wall_s
    keep, cap = 4 * limits.output_chars, int(limits.output_mb * 1024 * 1024)
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    written, total, timed_out, overflow = 0, 0, False, False
    selector = selectors.DefaultSelector()
    for stream in kept:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    try:
        while selector.get_map() and not overflow:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in selector.select(min(left, 1.0)):
                stream = key.fileobj
                if stream is proc.stdin:
                    try:
                        written += os.write(stream.fileno(), data[written : written + _CHUNK])
                    except BrokenPipeError:  # the program stopped reading: the rest is not wanted
                        written = len(data)
                    except BlockingIOError:
                        continue
                    if written >= len(data):
                        selector.unregister(stream)
                        stream.close()
                    continue
                try:
                    chunk = os.read(stream.fileno(), _CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(stream)
                    continue
                total += len(chunk)
                room = keep - len(kept[stream])
                if room > 0:
                    kept[stream] += chunk[:room]
                if total > cap:
                    overflow = True
                    break
        if not (timed_out or overflow):  # both pipes closed: wait for the exit within the deadline
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        selector.close()
        if timed_out or overflow or proc.poll() is None:
            _kill(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if not stream.closed:
                stream.close()
        try:
            proc.wait(timeout=5.0)  # SIGKILLed: at once, unless the kernel is stuck
        except subprocess.TimeoutExpired:
            log.warning("sandboxed process %d did not exit 5 s after SIGKILL", proc.pid)
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), timed_out, overflow


def _warn_if_unisolated(isolate: bool | None) -> bool:
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
    return isolate


def _run(
    argv: list[str],
    limits: Limits,
    isolate: bool,
    stdin: str,
    cwd: str,
    read_only: list[tuple[str, str]],
    writable: str | None,
    env: dict[str, str],
) -> Result:
    uid = _take_uid() if isolate and os.geteuid() == 0 and _setpriv_available() else None
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(
            _command(argv, isolate, limits, uid, read_only, writable),
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _set_limits(limits),
            env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", **env},
        )
        stdout, stderr, timed_out, overflow = _exchange(proc, stdin.encode(), limits)
        seconds = time.perf_counter() - start
    finally:
        _give_uid(uid)
    cut = limits.output_chars
    return Result(
        returncode=None if timed_out else proc.returncode,
        stdout=stdout.decode(errors="replace")[:cut],
        stderr=stderr.decode(errors="replace")[:cut],
        timed_out=timed_out,
        seconds=seconds,
        isolated=isolate,
        output_overflow=overflow,
    )


def run_python(code: str, limits: Limits = Limits(), isolate: bool | None = None, stdin: str = "") -> Result:
    """Run ``code`` with ``python -I`` in a sandbox, ``stdin`` on its standard input; never raises for
    anything the program does."""
    isolate = _warn_if_unisolated(isolate)
    # the real interpreter, not a venv's link to it: the sandbox needs no site-packages, and a venv
    # inside /tmp would be hidden by the sandbox's private /tmp
    interpreter = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory(prefix="lit_marl_sandbox-") as workdir:
        code_path = os.path.join(workdir, "program.py")
        with open(code_path, "w") as f:
            f.write(code)
        if not isolate:
            os.chmod(workdir, 0o777)  # the program writes its files here
        else:
            os.chmod(workdir, 0o755)
            os.chmod(code_path, 0o644)
        program = "/tmp/program.py" if isolate else code_path
        return _run(
            [interpreter, "-I", "-B", program],
            limits,
            isolate,
            stdin,
            workdir,
            [(code_path, "/tmp/program.py")],
            None,
            {"HOME": "/tmp" if isolate else workdir},
        )


def run_in(
    argv: list[str],
    workspace: str,
    limits: Limits = Limits(),
    read_only: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    isolate: bool | None = None,
    stdin: str = "",
) -> Result:
    """Run ``argv`` in the folder ``workspace`` (its working folder, and with bubblewrap the only
    host folder it can write: bound read-write at its own path, so paths are the same inside and
    out); ``read_only`` host paths are visible read-only at their own paths. Never raises for
    anything the program does."""
    isolate = _warn_if_unisolated(isolate)
    workspace = os.path.realpath(workspace)
    mounts = [(os.path.realpath(p), os.path.realpath(p)) for p in read_only]
    return _run(argv, limits, isolate, stdin, workspace, mounts, workspace, {"HOME": "/tmp", **(env or {})})


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
