"""The test harness's verdict, run by ``runner.py`` (its docstring: the design) in a namespace of its
own with private builtins, so nothing the code under test reaches leads to it."""

import functools
import json
import linecache
import os
import signal
import sys
import threading
import types

FunctionType, MethodType, CodeType = types.FunctionType, types.MethodType, types.CodeType  # captured: later
ModuleType, Partial = types.ModuleType, functools.partial  # patches of types or functools change nothing here
FRAME_APIS = {
    ("inspect", "currentframe"), ("inspect", "stack"), ("inspect", "trace"), ("inspect", "getouterframes"),
    ("inspect", "getinnerframes"), ("inspect", "getframeinfo"), ("traceback", "walk_stack"),
    ("traceback", "walk_tb"), ("traceback", "extract_stack"), ("traceback", "format_stack"),
    ("traceback", "print_stack"), ("traceback", "extract"), ("logging", "currentframe"), ("logging", "<lambda>"),
}  # fmt: skip
"""Standard-library functions that hand frames (or the source lines of the callers) to their caller."""
FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code"}
CODE_ATTRS = {"__code__", "__defaults__", "__kwdefaults__", "gi_code", "cr_code", "ag_code"}
ANYWHERE = {
    "sys._current_frames", "sys.settrace", "sys.setprofile", "sys.addaudithook", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn",
    "os.spawn", "subprocess.Popen", "os.kill", "os.killpg", "cpython.run_command", "cpython.run_file",
}  # fmt: skip
"""Events that are tampering whenever untrusted code is on the stack."""
DIRECT = {"function.__new__", "code.__new__", "marshal.loads", "marshal.load"}  # by untrusted code itself
MACHINERY = ("pytest", "_pytest", "pluggy", "unittest", "runner", "__main__", "_signal", "signal")
GUARDED_MODULES = {"_signal", "signal", "_ctypes", "ctypes", "gc", "_testcapi", "_testinternalcapi"}
"""Modules whose fresh import (after a ``del sys.modules[...]``) would hand out unguarded functions."""


class Harness:
    """The verdict: outcomes, tampering, the key and the report's descriptor; reached only through the
    audit hook. Everything it calls later is captured now (C functions, snapshots)."""

    def __init__(self, key, report_fd, codes, guards, workspace, base, roots, spec):
        import _hashlib
        import _signal

        import _pytest.python

        self.key, self.report_fd, self.workspace, self.base = key, report_fd, workspace, base
        self.getframe, self.get_ident, self.hmac_digest = sys._getframe, threading.get_ident, _hashlib.hmac_digest
        self.write, self.getsignal, self.dumps = os.write, _signal.getsignal, json.dumps
        import _pytest.unittest

        self.clear_lines, self.items_types = (
            linecache.clearcache,
            (_pytest.python.Function, _pytest.unittest.TestCaseFunction),
        )
        self.trusted_roots = tuple(root.rstrip("/") + "/" for root in [os.path.dirname(os.__file__), *roots])
        import inspect
        import logging
        import traceback

        modules = {"inspect": inspect, "traceback": traceback, "logging": logging, "linecache": linecache}
        self.wrapper_files = {module.__file__ for module in modules.values()}
        self.frame_apis = {(modules[module].__file__, name) for module, name in FRAME_APIS}
        self.runner_file = os.path.realpath(codes["finish"].co_filename)
        self.own_files = (self.runner_file, os.path.realpath(__file__))
        self.test_files = frozenset(os.path.join(workspace, t.split("::", 1)[0]) for t in spec["tests"]) | frozenset(
            f for f in base if "/tests/" in f or "/test/" in f or os.path.basename(f).startswith(("test_", "conftest"))
        )
        self.stat = os.stat
        sources = [f for f in self.test_files if f.endswith(".py")]  # the tests' data files stay readable
        self.guarded = {(f.st_dev, f.st_ino) for f in map(_stat, [*sources, *self.own_files]) if f}
        self.proc_dev = os.stat("/proc/self").st_dev
        folders = {f.rpartition("/")[0] for f in self.test_files} - {workspace}
        folders |= {p[:i] for p in folders for i in range(len(workspace) + 1, len(p)) if p[i] == "/"}
        self.protected = {(f.st_dev, f.st_ino) for f in map(_stat, [*self.test_files, *folders]) if f}
        self.codes, (self.Guarded, self.guarded_getattribute) = codes, guards
        self.checked_classes = set()
        self.modules = sys.modules
        self.busy, self.cache, self.tampered, self.outcomes, self.notes, self.accepted = set(), {}, [], {}, [], {}
        self.code_cache, self.failed = {}, set()
        self.changed_lines = {os.path.join(workspace, p): frozenset(n) for p, n in spec.get("lines", {}).items()}
        self.handlers, self.items, self.state = {}, {}, {}
        self.signals = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]
        self.snapshot = _snapshot(sys.modules)
        self.machinery = [name for name in self.snapshot[0] if name.split(".")[0] in MACHINERY]

    # ------------------------------------------------------------------ who is calling
    def untrusted(self, filename) -> bool:
        value = self.cache.get(filename) if type(filename) is str else True
        if value is None:
            if filename.startswith("<frozen "):
                value = False
            elif filename.startswith("<") or "/../" in filename or "/./" in filename or "//" in filename:
                value = True
            elif filename.startswith(self.workspace + "/"):
                value = filename not in self.base
            else:
                value = filename not in self.own_files and not filename.startswith(self.trusted_roots)
            self.cache[filename] = value
        return value

    def stack(self, depth: int, limit: int = 1 << 30) -> list:
        """Up to ``limit`` calling frames from ``depth`` (0: this one), innermost first, as (file,
        function name, untrusted, code). Reads only the frames' and codes' own fields: no code of
        anyone else runs while the thread's tripwires are paused (``busy``)."""
        tid = self.get_ident()
        self.busy.add(tid)
        try:
            frame, out = self.getframe(depth), []
            while frame is not None and len(out) < limit:
                code = frame.f_code
                filename = code.co_filename if type(code.co_filename) is str else "<?>"
                out.append((filename, code.co_name, self.untrusted_code(code), code))
                frame = frame.f_back
            return out
        finally:
            self.busy.discard(tid)

    def anywhere(self, depth: int = 3) -> bool:
        """Untrusted code anywhere on the stack (``depth``: 3 from the hook, 4 from ``own``)."""
        return any(frame[2] for frame in self.stack(depth))

    def reached_frames(self) -> bool:
        """Untrusted code reached for frames: directly, or through a frame-handing library function."""
        frames = self.stack(3, limit=16)  # stack, reached_frames, hook, then the code that read
        for i, (filename, _function, bad, _) in enumerate(frames):
            if bad:
                return i == 0 or (frames[i - 1][0], frames[i - 1][1]) in self.frame_apis
            if filename not in self.wrapper_files:
                return False
        return False

    def code_of(self, obj):
        """The code of a function, method, generator or coroutine; None for anything else (no
        attribute of any other object is read: its code could run here)."""
        tid = self.get_ident()
        self.busy.add(tid)
        try:
            kind = type(obj)
            if kind is MethodType:
                obj, kind = obj.__func__, type(obj.__func__)
            code = CODE_OF[kind](obj) if kind in CODE_OF else None
            return code if type(code) is CodeType and type(code.co_filename) is str else None
        finally:
            self.busy.discard(tid)

    def is_test(self, code) -> bool:  # a test's own code, not a helper a test hands to the library
        return code is not None and code.co_filename in self.test_files and code.co_name.startswith("test")

    def untrusted_obj(self, obj) -> bool:
        """An object whose code is untrusted, or that has no code of its own (a callable object)."""
        code = self.code_of(obj)
        return code is None or self.untrusted_code(code)

    def untrusted_code(self, code) -> bool:
        """Untrusted code: of an untrusted file; in a file the agent changed, only the module's own
        code and the functions (and classes) whose lines take in a changed line: an unchanged
        function of a changed file is the repository's."""
        value = self.code_cache.get(code)
        if value is None:
            lines = self.changed_lines.get(code.co_filename)
            value = self.untrusted(code.co_filename)
            if value and lines is not None and code.co_name != "<module>":
                span = [line for _, _, line in code.co_lines() if line is not None] or [code.co_firstlineno]
                low, high = min(code.co_firstlineno, *span), max(span)
                value = any(low <= line <= high for line in lines)
            self.code_cache[code] = value
        return value

    def guarded_file(self, path) -> bool:
        """A test's source, the harness, or anything of /proc (by the file itself: links and relative
        paths lead to the same inode)."""
        if type(path) is bytes:
            path = path.decode("utf-8", "surrogateescape")
        if type(path) is not str:
            return False
        try:
            found = self.stat(path)
        except (OSError, ValueError):
            return False
        return (found.st_dev, found.st_ino) in self.guarded or found.st_dev == self.proc_dev

    def mutates_tests(self, event: str, args) -> bool:
        """The event writes, removes, renames, truncates or re-modes a test file (its data included)
        or creates something in the tests' folders."""
        if event == "open":
            mode, flags = (args[1], args[2]) if len(args) > 2 else ("", 0)
            writing = (type(mode) is str and any(c in mode for c in "wax+")) or (type(flags) is int and flags & WRITES)
            if not writing:
                return False
        paths, dir_fd = (
            ([args[0], args[1]], None) if event in ("os.rename", "os.link", "os.symlink") else ([args[0]], None)
        )
        if event in ("os.remove", "os.rmdir", "os.mkdir") and type(args[-1]) is int and args[-1] >= 0:
            dir_fd = args[-1]
        for path in paths[1:] if event in ("os.link", "os.symlink") else paths:
            if type(path) is bytes:
                path = path.decode("utf-8", "surrogateescape")
            if type(path) is not str:
                continue
            for candidate in (path, path.rpartition("/")[0] or "."):
                try:
                    found = self.stat(candidate, dir_fd=dir_fd) if dir_fd is not None else self.stat(candidate)
                except (OSError, ValueError, TypeError):
                    continue
                if (found.st_dev, found.st_ino) in self.protected:
                    return True
                break  # the path itself exists: its folder is not what changes
        return False

    def refuse(self, reason: str):
        self.note(reason)
        raise RuntimeError("refused by the test harness: " + reason)

    def note(self, reason: str) -> None:
        if reason not in self.tampered and len(self.tampered) < 20:
            self.tampered.append(reason)

    # ------------------------------------------------------------------ the hook
    def hook(self, event, args):
        if self.get_ident() in self.busy:
            return
        if event.startswith("lit_marl."):
            return self.own(event[9:], args)
        if event in ("sys._getframe", "sys._getframemodulename"):
            if self.reached_frames():
                self.refuse("untrusted code read the stack's frames")
        elif event == "object.__getattr__":
            name = args[1] if len(args) > 1 else ""
            if name in FRAME_ATTRS and self.reached_frames():
                self.refuse(f"untrusted code read {name}")
            elif name in CODE_ATTRS and self.is_test(self.code_of(args[0])) and self.anywhere():
                self.refuse(f"untrusted code read {name} of a test")
        elif event in ("object.__setattr__", "object.__delattr__"):
            name = args[1] if len(args) > 1 else ""
            if name == "__bases__" and self.stack(2)[0][2]:  # (stack, hook, then the setter) typing sets bases
                self.refuse("untrusted code set __bases__")
            elif name in CODE_ATTRS and not self.untrusted_obj(args[0]) and self.anywhere():
                self.refuse(f"untrusted code set {name}")
        elif event in DIRECT and self.stack(2, limit=1)[0][2]:  # (stack, hook, then the caller)
            self.refuse(f"untrusted code called {event}")
        elif event in ANYWHERE or event.startswith(("ctypes.", "os.exec", "os.spawn", "os.posix_spawn")):
            if self.anywhere():
                self.refuse(f"untrusted code called {event}")
        elif event == "import" and args and args[0] in GUARDED_MODULES and self.anywhere():
            self.refuse(f"untrusted code imported {args[0]} afresh")
        elif event == "open" and args and self.guarded_file(args[0]) and self.anywhere():
            self.refuse(f"untrusted code opened {args[0]!r}")
        elif event in MUTATIONS and self.mutates_tests(event, args) and self.anywhere():
            self.refuse(f"untrusted code changed the tests' files ({event} {args[0]!r})")
        elif event == "compile" and len(args) > 1 and type(args[1]) is str and not args[1].startswith("<"):
            if self.stack(2, limit=1)[0][2]:  # the import system compiles sources; untrusted code may not name its own
                self.refuse(f"untrusted code compiled code named {args[1]}")

    def own(self, kind: str, args) -> None:
        if kind == "signal":
            if self.anywhere(4):
                self.refuse("untrusted code installed a signal handler")
        elif kind == "module":  # the first caller outside the standard library reads a guarded object
            caller = next((f for f in self.stack(4) if not f[0].startswith(self.trusted_roots[0])), None)
            if caller is not None and caller[2] and args[0] not in PLAIN_NAMES:
                self.refuse(f"untrusted code read {args[0]} of a guarded object")
        elif kind in self.codes and self.genuine(kind, args[0] if kind in ("outcome", "enter", "check") else None):
            getattr(self, "on_" + kind)(*args)

    def genuine(self, kind: str, item=None) -> bool:
        """The event comes from the runner's own code (the code object that raises it), with no
        untrusted code on the stack, about a real test item."""
        frames = self.stack(4)  # stack, genuine, own, hook, then the code that raised the event
        if not frames or frames[0][3] is not self.codes[kind] or any(f[2] for f in frames):
            self.note(f"{kind} reported by other code")
            return False
        if item is not None and type(item) not in self.items_types:
            self.note(f"{kind} for an object that is not a test")
            return False
        return True

    # ------------------------------------------------------------------ the runner's events
    def on_collected(self, session) -> None:
        problem = self.integrity(self.machinery, accept=True)
        config = session.config
        self.handlers.update({s: self.getsignal(s) for s in self.signals})
        self.state["plugins"] = set(config.pluginmanager.get_plugins())
        self.state["impls"] = {h: list(getattr(config.hook, h).get_hookimpls()) for h in HOOKS}
        problem = problem or self.plugin_origins(config) or self.importers() or self.item_origins(session.items)
        if problem:
            self.note(problem + " before the tests ran")
        self.items = {item.nodeid: (item, _function(item.obj), _params(item)) for item in session.items}
        import _pytest.assertion.util

        for module in [*self.modules.values(), _pytest.assertion.util]:  # the tests; pytest's current config and item
            if type(module) is ModuleType and (
                getattr(module, "__file__", None) in self.test_files or module is _pytest.assertion.util
            ):
                module.__class__ = self.Guarded
        for finder in sys.meta_path:  # pytest's assertion rewriter holds the session (and with it every item)
            cls = type(finder)
            if hasattr(finder, "session") and "__getattribute__" not in vars(cls):
                finder.__class__ = type(
                    "Guarded" + cls.__name__, (cls,), {"__getattribute__": self.guarded_getattribute}
                )

    def item_origins(self, items) -> str:
        """A collected test whose function is code of untrusted code (a module the code under test
        planted in sys.modules, or a finder of its own, stood in for a test module). Decorated tests
        (``unittest.skip``, ``mock.patch``) are the decorator's trusted code."""
        for item in items:
            if self.untrusted_obj(getattr(item, "obj", None)):
                return f"the test {item.nodeid} is untrusted code"
        return ""

    def importers(self) -> str:
        """An import finder or path hook of untrusted code."""
        for finder in [*sys.meta_path, *sys.path_hooks]:
            method = finder if callable(finder) and not isinstance(finder, type) else None
            method = getattr(finder, "find_spec", None) or getattr(finder, "find_module", None) or method
            if self.code_of(method) is not None and self.untrusted_obj(method):
                return f"an import finder of untrusted code ({type(finder).__name__})"
        return ""

    def on_enter(self, item) -> None:
        kept = self.items.get(item.nodeid)
        if kept is None or kept[0] is not item or _function(item.obj) is not kept[1] or "runtest" in vars(item):
            self.note(f"the test item {item.nodeid} was changed")
        elif _params(item) != kept[2]:
            self.note(f"the parameters of {item.nodeid} were changed")
        self.clear_lines()

    def on_outcome(self, item, outcome) -> None:
        problem = self.integrity(self.machinery) or self.machinery_state(item.config) or self.always_equal()
        if problem:
            self.note(problem)
        if item.nodeid in self.outcomes:
            self.note(f"{item.nodeid} reported twice")
        self.outcomes[item.nodeid] = outcome if not problem else "failed"

    def on_failed(self, nodeid) -> None:
        self.failed.add(nodeid)

    def on_check(self, item) -> None:
        problem = self.integrity(self.machinery) or self.machinery_state(item.config) or self.module_files()
        if problem:
            self.note(problem)

    def on_note(self, text) -> None:
        self.notes.append(str(text)[:200])

    def on_finish(self, code, log) -> None:
        problem = self.integrity(self.machinery) or self.integrity(list(self.snapshot[0]), strict=False)
        problem = problem or self.module_files()
        if problem:
            self.note(problem)
        self.outcomes.update({nodeid: "failed" for nodeid in self.failed if nodeid in self.outcomes})
        body = self.dumps(
            {"outcomes": self.outcomes, "exit": code, "log": log, "tampered": self.tampered, "notes": self.notes}
        )
        mac = self.hmac_digest(self.key, body.encode(), "sha256").hex()
        data = (mac + " " + body + "\n").encode()
        while data:
            data = data[self.write(self.report_fd, data) :]

    # ------------------------------------------------------------------ integrity
    def integrity(self, names, accept: bool = False, strict: bool = True) -> str:
        """The first attribute of the modules ``names`` (or their classes) changed since the snapshot.
        None -> a value is lazy initialization; ``accept`` (when collection ends) holds functions of
        trusted code pytest's plugins set; not ``strict``, only a value of untrusted code counts."""
        modules, classes = self.snapshot
        for name in names:
            module, before = modules[name]
            if self.modules.get(name) is not module:
                return f"sys.modules[{name!r}] was replaced"
            containers = [(name, module.__dict__, before)]
            containers += [(f"{name}.{cls.__name__}", cls.__dict__, attrs) for cls, attrs in classes.get(name, ())]
            for where, now, attrs in containers:
                for attr, value in attrs.items():
                    current = now.get(attr, _MISSING)
                    if current is value or value is None or self.accepted.get((id(attrs), attr), _MISSING) is current:
                        continue
                    if accept and type(current) is FunctionType and not self.untrusted_obj(current):
                        self.accepted[(id(attrs), attr)] = current
                        continue
                    if strict or self.untrusted_value(current):
                        return f"{where}.{attr} was changed"
        return ""

    def untrusted_value(self, value, depth: int = 0) -> bool:
        """Code of untrusted code: a function or method, a partial of one, a class defining one, or an
        instance of such a class."""
        kind = type(value)
        if kind in CODE_OF or kind is MethodType:
            return self.code_of(value) is not None and self.untrusted_obj(value)
        if kind is Partial and depth < 3:
            return self.untrusted_value(value.func, depth + 1)
        cls = value if isinstance(value, type) else kind
        return depth < 3 and any(
            type(member) is FunctionType and self.untrusted_obj(member)
            for member in list(type.__dict__["__dict__"].__get__(cls).values())
        )

    def always_equal(self) -> str:
        """A class of untrusted code whose instances claim to equal a fresh object (checked once per
        class, among the classes of the modules the agent changed or added)."""
        for module in list(self.modules.values()):
            filename = getattr(module, "__file__", None) if type(module) is ModuleType else None
            if type(filename) is not str or not self.untrusted(filename):
                continue
            for value in list(vars(module).values()):
                if isinstance(value, type) and value not in self.checked_classes:
                    self.checked_classes.add(value)
                    if _claims_equality(value):
                        return f"{value.__qualname__} claims to equal anything"
        return ""

    def machinery_state(self, config) -> str:
        if set(config.pluginmanager.get_plugins()) != self.state.get("plugins"):
            return "pytest's plugins changed"
        for hook_name, impls in self.state.get("impls", {}).items():
            if list(getattr(config.hook, hook_name).get_hookimpls()) != impls:
                return f"pytest's {hook_name} implementations changed"
        for s, handler in self.handlers.items():
            if self.getsignal(s) is not handler:
                return f"the handler of signal {s} changed"
        return ""

    def plugin_origins(self, config) -> str:
        """A hook implementation of untrusted code (a plugin the code under test registered)."""
        for hook_name in HOOKS:
            for impl in getattr(config.hook, hook_name).get_hookimpls():
                if self.untrusted_obj(impl.function):
                    return f"a {hook_name} implementation of untrusted code ({impl.plugin_name})"
        return ""

    def module_files(self) -> str:
        """A module of the repository registered under another module's name (a package that swaps
        the tested module in sys.modules)."""
        for name, module in list(self.modules.items()):
            expected = [self.workspace + "/" + name.replace(".", "/") + tail for tail in (".py", "/__init__.py")]
            if not any(path in self.base for path in expected):
                continue
            found = getattr(module, "__file__", None) if type(module) in (ModuleType, self.Guarded) else None
            if found not in expected and (type(found) is not str or self.untrusted(found)):  # (tlz aliases toolz)
                return f"sys.modules[{name!r}] is not the repository's {name}"
        return ""


PLAIN_NAMES = {"__class__", "__name__", "__qualname__", "__module__", "__spec__", "__file__", "__package__", "__path__"}
"""Attributes of a guarded object anyone may read (``isinstance``, ``inspect.getmodule`` read them)."""
MUTATIONS = {"open", "os.remove", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.link",
             "os.symlink", "os.rmdir", "os.mkdir", "shutil.rmtree"}  # fmt: skip
WRITES = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
CODE_OF = {
    FunctionType: lambda f: f.__code__,
    types.GeneratorType: lambda g: g.gi_code,
    types.CoroutineType: lambda c: c.cr_code,
    types.AsyncGeneratorType: lambda a: a.ag_code,
}


def _function(obj):
    """A bound method's function (a unittest test's method is bound anew to each test's instance)."""
    return obj.__func__ if type(obj) is MethodType else obj


def _params(item) -> str:
    """A parametrized test's parameters, as text (changed in place or replaced, they differ)."""
    callspec = getattr(item, "callspec", None)
    return repr(sorted(callspec.params.items(), key=lambda kv: kv[0])) if callspec is not None else ""


HOOKS = ("pytest_runtest_call", "pytest_runtest_protocol", "pytest_runtest_makereport", "pytest_pyfunc_call",
         "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_runtest_logreport")  # fmt: skip
_MISSING = object()


def _snapshot(modules) -> tuple[dict, dict]:
    """Every loaded module's attributes, and the attributes of the classes each defines."""
    out, classes = {}, {}
    for name, module in list(modules.items()):
        if type(module) is not ModuleType:
            continue
        out[name] = (module, dict(module.__dict__))
        own = [v for v in module.__dict__.values() if isinstance(v, type) and getattr(v, "__module__", None) == name]
        classes[name] = [(cls, dict(cls.__dict__)) for cls in own]
    return out, classes


def _stat(path: str):
    try:
        return os.stat(path)
    except OSError:
        return None


def _claims_equality(cls) -> bool:
    """Whether an instance of ``cls`` (made without its ``__init__``) equals a fresh object."""
    try:
        instance = cls.__new__(cls)
        return bool(instance == object()) or not bool(instance != object())
    except Exception:
        return False
