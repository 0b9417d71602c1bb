"""The test harness's verdict, run by ``runner.py`` (its docstring: the design), with
``harness_checks.py`` and ``harness_equality.py``, in a namespace of their own with private builtins.

There is no class here: the verdict's state is one ``SimpleNamespace`` (``h``) held by the audit hook
(a ``functools.partial``) and passed down the calls. No Python object leads to the hook, so none leads
to the state, the key or the functions of this namespace (classes would: ``object.__subclasses__()``
finds every class, and a class leads to its methods and their globals). While the harness runs, no
frame may be read (its frames would lead to the state), and outcomes leave the process as they are
decided, one signed, numbered line each.
"""

import functools
import linecache
import os
import signal
import sys
import threading
import types

FunctionType, MethodType, CodeType = types.FunctionType, types.MethodType, types.CodeType  # captured: later
ModuleType, Partial, Namespace = types.ModuleType, functools.partial, types.SimpleNamespace  # patches change nothing
FRAME_APIS = {
    ("inspect", "currentframe"), ("inspect", "stack"), ("inspect", "trace"), ("inspect", "getouterframes"),
    ("inspect", "getinnerframes"), ("inspect", "getframeinfo"), ("traceback", "walk_stack"),
    ("traceback", "walk_tb"), ("traceback", "extract_stack"), ("traceback", "format_stack"),
    ("traceback", "print_stack"), ("traceback", "extract"), ("logging", "currentframe"), ("logging", "<lambda>"),
}  # fmt: skip
"""Standard-library functions that hand frames (or the source lines of the callers) to their caller."""
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code"})
CODE_ATTRS = frozenset({"__code__", "__defaults__", "__kwdefaults__", "gi_code", "cr_code", "ag_code"})
ALWAYS = frozenset({
    "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents",
})  # fmt: skip
"""Events refused whoever calls them: nothing the tests need, and each hands out every object or frame."""
ANYWHERE = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "os.kill", "os.killpg", "cpython.run_command", "cpython.run_file",
})  # fmt: skip
"""Events that are tampering whenever untrusted code is on the stack."""
DIRECT = frozenset({"function.__new__", "code.__new__", "marshal.loads", "marshal.load"})  # by untrusted code itself
MACHINERY = ("pytest", "_pytest", "pluggy", "unittest", "runner", "__main__", "_signal", "signal")
GUARDED_MODULES = frozenset({"_signal", "signal", "_ctypes", "ctypes", "gc", "_testcapi", "_testinternalcapi"})
"""Modules whose fresh import (after a ``del sys.modules[...]``) would hand out unguarded functions."""
THREAD_STARTS = ("/threading.py", "/concurrent/futures/thread.py")
"""Where a thread's own code begins: in a thread the runner did not start, these frames are untrusted
(they run whatever they were handed), so the thread is untrusted from birth."""
PLAIN_NAMES = frozenset({"__class__", "__name__", "__qualname__", "__module__", "__spec__", "__file__", "__package__",
                         "__path__"})  # fmt: skip
"""Attributes of a guarded object anyone may read (``isinstance``, ``inspect.getmodule`` read them)."""
MUTATIONS = frozenset({"open", "os.remove", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.link",
                       "os.symlink", "os.rmdir", "os.mkdir", "shutil.rmtree"})  # fmt: skip
WRITES = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
CODE_OF = {
    FunctionType: lambda f: f.__code__,
    types.GeneratorType: lambda g: g.gi_code,
    types.CoroutineType: lambda c: c.cr_code,
    types.AsyncGeneratorType: lambda a: a.ag_code,
}
STR_ENCODE = str.encode


def build(key, report_fd, codes, guards, workspace, base, roots, spec):
    """The audit hook (to be installed at once, before any code of the workspace is imported), its
    state built now: everything it calls later is captured here (C functions, snapshots)."""
    import _hashlib
    import _signal
    import inspect
    import logging
    import traceback

    import _pytest.python
    import _pytest.unittest

    h = Namespace(key=key, report_fd=report_fd, workspace=workspace, base=base, codes=codes, seq=0)
    h.lock = threading.Lock()
    h.getframe, h.get_ident, h.hmac_digest, h.write = sys._getframe, threading.get_ident, _hashlib.hmac_digest, os.write
    h.getsignal, h.stat, h.clear_lines, h.main = _signal.getsignal, os.stat, linecache.clearcache, threading.get_ident()
    h.items_types = (_pytest.python.Function, _pytest.unittest.TestCaseFunction)
    stdlib = os.path.dirname(os.__file__).rstrip("/") + "/"
    h.trusted_roots = (stdlib, *(root.rstrip("/") + "/" for root in roots))
    h.thread_starts = tuple(stdlib + tail[1:] for tail in THREAD_STARTS)
    modules = {"inspect": inspect, "traceback": traceback, "logging": logging, "linecache": linecache}
    h.wrapper_files = {module.__file__ for module in modules.values()}
    h.frame_apis = {(modules[module].__file__, name) for module, name in FRAME_APIS}
    h.own_files = (os.path.realpath(codes["finish"].co_filename), *HARNESS_FILES)
    h.test_files = frozenset(os.path.join(workspace, t.split("::", 1)[0]) for t in spec["tests"]) | frozenset(
        f for f in base if "/tests/" in f or "/test/" in f or os.path.basename(f).startswith(("test_", "conftest"))
    )
    sources = [f for f in h.test_files if f.endswith(".py")]  # the tests' data files stay readable
    h.guarded = {(f.st_dev, f.st_ino) for f in map(_stat, [*sources, *h.own_files]) if f}
    h.test_sources = {(f.st_dev, f.st_ino) for f in map(_stat, sources) if f}
    h.line_cache = linecache.cache  # the same dict, a dict, for the whole run (it is cleared before each test)
    h.proc_dev = os.stat("/proc/self").st_dev
    folders = {f.rpartition("/")[0] for f in h.test_files} - {workspace}
    folders |= {p[:i] for p in folders for i in range(len(workspace) + 1, len(p)) if p[i] == "/"}
    h.protected = {(f.st_dev, f.st_ino) for f in map(_stat, [*h.test_files, *folders]) if f}
    h.Guarded, h.guarded_getattribute = guards
    h.modules = sys.modules
    h.busy, h.active, h.cache, h.code_cache = set(), {}, {}, {}
    h.tampered, h.outcomes, h.notes, h.accepted, h.failed = [], {}, [], {}, set()
    h.changed_lines = {os.path.join(workspace, p): frozenset(n) for p, n in spec.get("lines", {}).items()}
    h.handlers, h.items, h.state, h.current, h.collected = {}, {}, {}, None, False
    h.signals = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
    prepare_equality(h)  # before the snapshot: the wrapped comparisons are the baseline
    h.snapshot = _snapshot(sys.modules)
    h.machinery = [name for name in h.snapshot[0] if name.split(".")[0] in MACHINERY]
    emit(h, "ready")
    return Partial(hook, h)


# ---------------------------------------------------------------------- who is calling
def untrusted(h, filename) -> bool:
    value = h.cache.get(filename) if type(filename) is str else True
    if value is None:
        if filename.startswith("<frozen "):
            value = False
        elif filename.startswith("<") or "/../" in filename or "/./" in filename or "//" in filename:
            value = True
        elif filename.startswith(h.workspace + "/"):
            value = filename not in h.base
        else:
            value = filename not in h.own_files and not filename.startswith(h.trusted_roots)
        h.cache[filename] = value
    return value


def stack(h, depth: int, limit: int = 1 << 30) -> list:
    """Up to ``limit`` calling frames from ``depth`` (0: this one), innermost first, as (file,
    function name, untrusted, code). Reads only the frames' and codes' own fields: no code of anyone
    else runs while the thread's tripwires are paused (``busy``). In a thread the runner did not start,
    the thread's own start (``THREAD_STARTS``) counts as untrusted code."""
    tid = h.get_ident()
    h.busy.add(tid)
    try:
        frame, out, foreign = h.getframe(depth), [], tid != h.main
        while frame is not None and len(out) < limit:
            code = frame.f_code
            filename = code.co_filename if type(code.co_filename) is str else "<?>"
            bad = untrusted_code(h, code) or (foreign and filename in h.thread_starts)
            out.append((filename, code.co_name, bad, code))
            frame = frame.f_back
        return out
    finally:
        h.busy.discard(tid)


def suspect(h) -> bool:
    """Any frame or object read now is suspect: the harness itself is running in this thread (a
    finalizer or callback that fires inside it would reach its frames)."""
    return h.active.get(h.get_ident(), 0) > 0


def anywhere(h, depth: int = 3) -> bool:
    """Untrusted code anywhere on the stack (``depth``: 3 from the hook, 4 from ``own``)."""
    return suspect(h) or any(frame[2] for frame in stack(h, depth))


def reached_frames(h) -> bool:
    """Untrusted code reached for frames: directly, or through a frame-handing library function."""
    if suspect(h):
        return True
    frames = stack(h, 3, limit=64)  # stack, reached_frames, hook, then the code that read
    for i, (filename, _function, bad, _) in enumerate(frames):
        if bad:
            return i == 0 or (frames[i - 1][0], frames[i - 1][1]) in h.frame_apis
        if filename not in h.wrapper_files:
            return False
    return h.get_ident() != h.main  # a thread's stack of library wrappers only


def read_by_name(h, name: str) -> bool:
    """The code that reads ``name`` of a test function says so itself, and its caller calls it by name:
    pytest's and inspect's readers do; a chain of C callables left for trusted code to run later
    (``map(attrgetter('__code__'), tests)``, ``map(getrawcode, tests)``) does not."""
    frames = stack(h, 3, limit=2)  # stack, read_by_name, hook, then the reader and its caller
    if len(frames) < 2:
        return False
    reader, caller = frames[0][3], frames[1][3]
    return (name in reader.co_names or name in reader.co_consts) and (
        reader.co_name in caller.co_names or reader.co_name in caller.co_consts
    )


def code_of(h, obj):
    """The code of a function, method, generator or coroutine; None for anything else (no attribute
    of any other object is read: its code could run here)."""
    tid = h.get_ident()
    h.busy.add(tid)
    try:
        kind = type(obj)
        if kind is MethodType:
            obj, kind = obj.__func__, type(obj.__func__)
        code = CODE_OF[kind](obj) if kind in CODE_OF else None
        return code if type(code) is CodeType and type(code.co_filename) is str else None
    finally:
        h.busy.discard(tid)


def is_test(h, code) -> bool:  # a test's own code, not a helper a test hands to the library
    return code is not None and code.co_filename in h.test_files and code.co_name.startswith("test")


def untrusted_obj(h, obj) -> bool:
    """An object whose code is untrusted, or that has no code of its own (a callable object)."""
    code = code_of(h, obj)
    return code is None or untrusted_code(h, code)


def untrusted_code(h, code) -> bool:
    """Untrusted code: of an untrusted file; in a file the agent changed, only the module's own code
    and the functions (and classes) whose lines take in a changed line: an unchanged function of a
    changed file is the repository's."""
    value = h.code_cache.get(code)
    if value is None:
        lines = h.changed_lines.get(code.co_filename)
        value = untrusted(h, code.co_filename)
        if value and lines is not None and code.co_name != "<module>":
            span = [line for _, _, line in code.co_lines() if line is not None] or [code.co_firstlineno]
            low, high = min(code.co_firstlineno, *span), max(span)
            value = any(low <= line <= high for line in lines)
        h.code_cache[code] = value
    return value


def guarded_file(h, path) -> bool:
    """A test's source, the harness, or anything of /proc (by the file itself: links and relative
    paths lead to the same inode)."""
    found = file_id(h, path)
    return found is not None and (found in h.guarded or found[0] == h.proc_dev)


def file_id(h, path):
    """(device, inode) of ``path`` (a str or bytes path), None when there is none."""
    if type(path) is bytes:
        path = path.decode("utf-8", "surrogateescape")
    if type(path) is not str:
        return None
    try:
        found = h.stat(path)
    except (OSError, ValueError):
        return None
    return found.st_dev, found.st_ino


def mutates_tests(h, event: str, args) -> bool:
    """The event writes, removes, renames, truncates or re-modes a test file (its data included) or
    creates something in the tests' folders."""
    if event == "open":
        mode, flags = (args[1], args[2]) if len(args) > 2 else ("", 0)
        writing = (type(mode) is str and any(c in mode for c in "wax+")) or (type(flags) is int and flags & WRITES)
        if not writing:
            return False
    paths = [args[0], args[1]] if event in ("os.rename", "os.link", "os.symlink") else [args[0]]
    at_fd = event in ("os.remove", "os.rmdir", "os.mkdir") and type(args[-1]) is int and args[-1] >= 0
    dir_fd = args[-1] if at_fd else None
    for path in paths[1:] if event in ("os.link", "os.symlink") else paths:
        if type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        if type(path) is not str:
            continue
        for candidate in (path, path.rpartition("/")[0] or "."):
            try:
                found = h.stat(candidate, dir_fd=dir_fd) if dir_fd is not None else h.stat(candidate)
            except (OSError, ValueError, TypeError):
                continue
            if (found.st_dev, found.st_ino) in h.protected:
                return True
            break  # the path itself exists: its folder is not what changes
    return False


def refuse(h, reason: str):
    note(h, reason)
    raise RuntimeError("refused by the test harness: " + reason)


def note(h, reason: str) -> None:
    """Tampering: kept, and sent out at once (a later failure of the run cannot take it back)."""
    if reason not in h.tampered and len(h.tampered) < 20:
        h.tampered.append(reason)
        emit(h, "tamper", reason)


def emit(h, kind: str, *fields) -> None:
    """One line out, numbered and signed: ``<hmac> <seq> <kind> <hex field>...``. Only C functions run
    (captured when the hook was built): nothing the code under test patched takes part."""
    with h.lock:  # a thread's refusal and the runner's outcome: one line after the other, numbered in turn
        body = str(h.seq) + " " + kind
        for value in fields:
            body += " " + STR_ENCODE(value if type(value) is str else "?", "utf-8", "surrogateescape").hex()
        h.seq += 1
        data = STR_ENCODE(h.hmac_digest(h.key, STR_ENCODE(body), "sha256").hex() + " " + body + "\n")
        while data:
            data = data[h.write(h.report_fd, data) :]


# ---------------------------------------------------------------------- the hook
def hook(h, event, args):
    if h.get_ident() in h.busy:
        return
    if event.startswith("lit_marl."):
        return own(h, event[9:], args)
    if event in ALWAYS:
        refuse(h, f"code called {event}")
    elif event in ("sys._getframe", "sys._getframemodulename"):
        if reached_frames(h):
            refuse(h, "untrusted code read the stack's frames")
    elif event == "object.__getattr__":
        name = args[1] if len(args) > 1 else ""
        if name in FRAME_ATTRS and reached_frames(h):
            refuse(h, f"untrusted code read {name}")
        elif name in CODE_ATTRS and is_test(h, code_of(h, args[0])):
            if anywhere(h) or (h.collected and not read_by_name(h, name)):
                refuse(h, f"untrusted code read {name} of a test")
    elif event in ("object.__setattr__", "object.__delattr__"):
        name = args[1] if len(args) > 1 else ""
        # (stack, hook, then the setter): typing sets __bases__
        if name == "__bases__" and (suspect(h) or stack(h, 2)[0][2]):
            refuse(h, "untrusted code set __bases__")
        elif name in CODE_ATTRS and (id(args[0]) in h.own_ids or not untrusted_obj(h, args[0]) and anywhere(h)):
            refuse(h, f"untrusted code set {name}")
    elif event in DIRECT and (suspect(h) or stack(h, 2, limit=1)[0][2]):  # (stack, hook, then the caller)
        refuse(h, f"untrusted code called {event}")
    elif event in ANYWHERE or event.startswith(("ctypes.", "os.exec", "os.spawn", "os.posix_spawn")):
        if anywhere(h):
            refuse(h, f"untrusted code called {event}")
    elif event == "import" and args and args[0] in GUARDED_MODULES and anywhere(h):
        refuse(h, f"untrusted code imported {args[0]} afresh")
    elif event == "open" and args and guarded_file(h, args[0]):
        if anywhere(h):
            refuse(h, f"untrusted code opened {args[0]!r}")
        if h.collected and file_id(h, args[0]) in h.test_sources:  # no one reads them while they run
            raise PermissionError("the test harness keeps the tests' sources closed while the tests run")
    elif event in MUTATIONS and mutates_tests(h, event, args) and anywhere(h):
        refuse(h, f"untrusted code changed the tests' files ({event} {args[0]!r})")
    elif event == "exec" and args and type(args[0]) is CodeType and args[0].co_filename in h.test_files:
        guard_module_of(h, args[0].co_filename)  # before the test module's code runs: it is guarded from birth
    elif event == "compile" and len(args) > 1 and type(args[1]) is str and not args[1].startswith("<"):
        if suspect(h) or stack(h, 2, limit=1)[0][2]:  # the import system compiles sources; untrusted code may not
            refuse(h, f"untrusted code compiled code named {args[1]}")


def own(h, kind: str, args) -> None:
    if kind == "signal":
        if anywhere(h, 4):
            refuse(h, "untrusted code installed a signal handler")
    elif kind == "module":  # the first caller outside the standard library reads a guarded object
        caller = next((f for f in stack(h, 4) if f[2] or not f[0].startswith(h.trusted_roots[0])), None)
        if (suspect(h) or caller is None or caller[2]) and args[0] not in PLAIN_NAMES:
            refuse(h, f"untrusted code read {args[0]} of a guarded object")
    elif kind in ("equal", "class", "compared"):  # anyone may ask for a check: it can only find tampering
        running(h, {"equal": claimed_equal, "class": new_class, "compared": compared}[kind], args)
    elif kind in h.codes and genuine(h, kind, args[0] if kind in ("outcome", "enter", "check", "calling") else None):
        running(h, ON[kind], args)


def running(h, check, args) -> None:
    """``check(h, *args)`` with this thread's harness marked running (``suspect``)."""
    tid = h.get_ident()
    h.active[tid] = h.active.get(tid, 0) + 1
    try:
        check(h, *args)
    finally:
        h.active[tid] -= 1


def genuine(h, kind: str, item=None) -> bool:
    """The event comes from the runner's own code (the code object that raises it), in the runner's
    thread, with no untrusted code on the stack, about a real test item."""
    frames = stack(h, 4)  # stack, genuine, own, hook, then the code that raised the event
    if h.get_ident() != h.main or suspect(h) or not frames or frames[0][3] is not h.codes[kind]:
        note(h, f"{kind} reported by other code")
        return False
    if any(f[2] for f in frames):
        note(h, f"{kind} reported with untrusted code on the stack")
        return False
    if item is not None and type(item) not in h.items_types:
        note(h, f"{kind} for an object that is not a test")
        return False
    return True


def _stat(path: str):
    try:
        return os.stat(path)
    except OSError:
        return None
