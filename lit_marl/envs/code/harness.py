"""Test harness that runs INSIDE the sandbox (stdlib only; this file is the sandboxed program).

Why two processes: a check that runs in the candidate's own process can be forged (patch
``assert`` or ``__eq__``, ``os._exit(0)`` before the tests, print a fake report, find any nonce
through ``gc`` or ``/proc/self``). So the candidate program is loaded into a child process (the
*server*) and the tests run here, in the harness, calling the candidate's functions through a
pipe. Only plain data crosses the pipe (None, bool, int, float, str, bytes, list, tuple, dict,
set, decoded into fresh builtins here), so every comparison runs on untouched builtins in a
process the candidate cannot reach: the harness makes itself non-dumpable (no ``/proc/<pid>/mem``
or ``/proc/<pid>/fd`` for same-user processes), closes its fds in the child, and signs its
report with a nonce that it read from stdin before the candidate ran. A candidate that kills
the harness, or exits, or hangs gets no credit for tests it did not pass.

Input (stdin, JSON): nonce, program (source), tests ([{setup, code}]), entry_point, provided (the
task's own code the tests may use: run in the tests' namespace, never in the program's),
load_timeout_s, test_timeout_s, budget_s, max_response_bytes.
Output: one line ``<nonce><JSON report>`` on stdout.
"""

import ctypes
import json
import os
import platform
import select
import signal
import subprocess
import sys
import time


def encode(v):
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return {"__t": "float", "v": repr(v)}
    if t is list:
        return [encode(x) for x in v]
    if t is tuple:
        return {"__t": "tuple", "v": [encode(x) for x in v]}
    if t is dict:
        return {"__t": "dict", "v": [[encode(k), encode(x)] for k, x in v.items()]}
    if t in (set, frozenset):
        return {"__t": t.__name__, "v": [encode(x) for x in v]}
    if t is bytes:
        return {"__t": "bytes", "v": v.hex()}
    raise TypeError(f"a value of type {t.__name__} cannot cross between the tests and the program (plain data only)")


def decode(v):
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        t, x = v["__t"], v["v"]
        if t == "float":
            return float(x)
        if t == "bytes":
            return bytes.fromhex(x)
        if t == "dict":
            return {decode(k): decode(y) for k, y in x}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[t](decode(y) for y in x)
    if v is None or type(v) in (bool, int, str):
        return v
    raise TypeError("malformed reply")


def forbid_fork():
    """A seccomp filter: no new processes (fork, vfork, clone without CLONE_THREAD), threads still
    work. RLIMIT_NPROC cannot stop a fork bomb when the trainer runs as root."""
    spec = {"x86_64": (0xC000003E, [57, 58], 56), "aarch64": (0xC00000B7, [], 220)}.get(platform.machine())
    if spec is None:
        return f"no fork filter for {platform.machine()}"
    audit, forks, clone = spec
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ins = []

    def op(code, k=0, jt=0, jf=0):
        ins.append([code, jt, jf, k])

    op(LD, 4)  # the calling convention: any other (e.g. 32-bit syscalls) is refused
    op(JEQ, audit, 0, "deny")
    op(LD, 0)  # the syscall number
    if audit == 0xC000003E:
        op(JGE, 0x40000000, "deny", 0)  # the x32 ABI
    for nr in forks:
        op(JEQ, nr, "deny", 0)
    op(JEQ, 435, "nosys", 0)  # clone3: its flags are out of reach; libc falls back to clone
    op(JEQ, clone, 0, "allow")
    op(LD, 16)  # clone's flags (low word of the first argument)
    op(JSET, 0x10000, "allow", "deny")  # CLONE_THREAD
    labels = {}
    for name, k in (("allow", 0x7FFF0000), ("deny", 0x00050001), ("nosys", 0x00050026)):
        labels[name] = len(ins)
        op(RET, k)
    for i, x in enumerate(ins):
        for j in (1, 2):
            if isinstance(x[j], str):
                x[j] = labels[x[j]] - i - 1

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    program = Program(len(ins), (Filter * len(ins))(*[Filter(*x) for x in ins]))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(program), 0, 0):
        return f"seccomp refused (errno {ctypes.get_errno()})"
    return ""


def serve() -> None:
    """The server: load the candidate program, then answer calls (one JSON line each way)."""
    out = os.fdopen(os.dup(1), "w")  # the reply channel; the candidate's prints go to stderr
    os.dup2(2, 1)

    def send(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    guard = forbid_fork()
    ns = {"__name__": "__main__"}
    try:
        exec(compile(json.loads(sys.stdin.readline()), "<program>", "exec"), ns)
        names = [k for k, v in ns.items() if callable(v) and not k.startswith("__")]
        send({"ok": True, "guard": guard, "names": names})
    except BaseException as e:
        send({"ok": False, "error": type(e).__name__, "message": str(e)[:300]})
        return
    for line in sys.stdin:
        request = json.loads(line)
        try:
            args = decode(request["args"])
            kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
            send({"ok": True, "value": encode(ns[request["name"]](*args, **kwargs))})
        except BaseException as e:
            send({"ok": False, "error": type(e).__name__, "message": str(e)[:300]})


class ProgramDied(Exception):
    """The program's process exited, hung past the test's time or broke the protocol."""


class Server:
    """The candidate program in its own process; calls cross a pipe as plain data."""

    def __init__(self, program: str, max_bytes: int, timeout: float):
        self.max_bytes = max_bytes
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", os.path.abspath(__file__), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            process_group=0,  # killed as a group: the candidate's own children go with it
            preexec_fn=lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL),  # dies with the harness
        )
        self.buffer = b""
        self.send(program)
        reply = self.receive(time.monotonic() + timeout)
        if not reply["ok"]:
            raise ProgramDied(f"{reply['error']}: {reply['message']}")
        self.names, self.guard = reply["names"], reply["guard"]

    def send(self, msg) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as err:
            raise ProgramDied("the program's process exited") from err

    def receive(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProgramDied("timed out")
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise ProgramDied("the program's process exited")
            self.buffer += chunk
            if len(self.buffer) > self.max_bytes:
                raise ProgramDied("the program's reply is too large")
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:  # the candidate can write to this pipe itself: trust only the shape
            reply = json.loads(line)
            if reply["ok"] is True:
                expected = {"ok", "value"} if "value" in reply else {"ok", "guard", "names"}
                if set(reply) != expected:
                    raise ValueError("unexpected fields")
                return {**reply, "value": decode(reply["value"])} if "value" in reply else reply
            return {"ok": False, "error": str(reply["error"]), "message": str(reply["message"])}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ProgramDied("the program broke the harness protocol") from err

    def proxy(self, name: str, deadline_of):
        def call(*args, **kwargs):
            self.send({"name": name, "args": encode(list(args)), "kwargs": {k: encode(v) for k, v in kwargs.items()}})
            reply = self.receive(deadline_of())
            if not reply["ok"]:
                raise RuntimeError(f"{reply['error']}: {reply['message']}")
            return reply["value"]

        call.__name__ = name
        return call

    def kill(self) -> None:
        for kill in (os.killpg, os.kill):  # its group, and the process itself should it have left it
            try:
                kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:  # never hold the harness for it: the sandbox's end kills it
            pass


def main() -> None:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: same-user processes cannot read our memory
    spec = json.loads(sys.stdin.read())
    nonce, tests = spec["nonce"], spec["tests"]
    report = {"loaded": False, "load_error": "", "guard": "", "tests": []}
    server, why_not = None, ""
    deadline = [0.0]

    def start():  # loading (interpreter start + the program's top level) has its own allowance
        return Server(spec["program"], spec["max_response_bytes"], spec["load_timeout_s"])

    try:
        server = start()
        report["loaded"], report["guard"] = True, server.guard
    except ProgramDied as err:
        report["load_error"] = why_not = str(err)
    budget_end = time.monotonic() + spec["budget_s"]
    for test in tests:
        if server is None:  # a program that cannot load (or exhausted its time) passes nothing
            report["tests"].append({"passed": False, "error": "NotRun", "message": why_not})
            continue
        deadline[0] = min(time.monotonic() + spec["test_timeout_s"], budget_end)
        # the tests see the builtins, what the task provides (its prompt's imports and helpers, run
        # here from the task's own source) and the entry point; nothing else the program defines,
        # so a program cannot redefine `abs`, `tuple` or the task's `poly` for the tests
        env = {"__builtins__": __builtins__}
        outcome = {"passed": False, "error": "", "message": ""}
        try:
            exec(spec["provided"], env)
            if spec["entry_point"] in server.names:
                env["candidate"] = server.proxy(spec["entry_point"], lambda: deadline[0])
                env.setdefault(spec["entry_point"], env["candidate"])
        except Exception as err:  # the task's own code fails: no test can pass
            message = f"the task's provided code failed: {type(err).__name__}: {err}"
            outcome.update(error="TaskError", message=message[:300])
            report["tests"].append(outcome)
            continue
        try:
            exec(test["setup"], env)
            exec(test["code"], env)
            outcome["passed"] = True
        except ProgramDied as err:
            outcome.update(error="ProgramDied", message=str(err))
        except AssertionError as err:
            outcome.update(error="AssertionError", message=str(err)[:300])
        except Exception as err:
            outcome.update(error=type(err).__name__, message=str(err)[:300])
        report["tests"].append(outcome)
        if outcome["error"] == "ProgramDied":  # a fresh process for the next test
            server.kill()
            server, why_not = None, "not run: the time budget is spent"
            if time.monotonic() < budget_end:
                try:
                    server = start()
                except ProgramDied as err:
                    why_not = f"not run: the program did not restart ({err})"
    if server is not None:
        server.kill()
    sys.stdout.write(nonce + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
