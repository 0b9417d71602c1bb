"""The harness's checks and the runner's events (run with ``harness.py`` and ``harness_equality.py``, in
their namespace: the design is in ``runner.py``'s docstring). Every function takes the verdict's state
``h``."""

import linecache
import sys

MISSING = object()
HOOKS = ("pytest_runtest_call", "pytest_runtest_protocol", "pytest_runtest_makereport", "pytest_pyfunc_call",
         "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_runtest_logreport", "pytest_assertrepr_compare",
         "pytest_assertion_pass")  # fmt: skip


# ---------------------------------------------------------------------- the runner's events
def on_collected(h, session) -> None:
    problem = integrity(h, h.machinery, accept=True)
    config = session.config
    h.handlers.update({s: h.getsignal(s) for s in h.signals})
    h.state["plugins"] = set(config.pluginmanager.get_plugins())
    h.state["hooks"], h.state["callbacks"], h.state["gc"] = hook_state(config), callback_hooks(), list(h.gc_callbacks)
    problem = problem or plugin_origins(h, config) or importers(h) or item_origins(h, session.items)
    if problem:
        note(h, problem + " before the tests ran")
    h.items = {item.nodeid: (item, _function(item.obj), _params(item)) for item in session.items}
    import _pytest.assertion.util

    for module in [*h.modules.values(), _pytest.assertion.util]:  # the tests; pytest's current config and item
        if type(module) is ModuleType and (
            getattr(module, "__file__", None) in h.test_files or module is _pytest.assertion.util
        ):
            module.__class__ = h.Guarded
    h.test_modules = [
        (m, dict(h.module_dict(m)))
        for m in h.modules.values()
        if type(m) is h.Guarded and h.module_dict(m).get("__file__") in h.test_files
    ]
    problem = test_globals(h)
    if problem:
        note(h, problem)
    h.collected = True
    h.clear_lines()  # what collection read of the tests' sources
    for finder in sys.meta_path:  # pytest's assertion rewriter holds the session (and with it every item)
        cls = type(finder)
        if hasattr(finder, "session") and "__getattribute__" not in vars(cls):
            finder.__class__ = type("Guarded" + cls.__name__, (cls,), {"__getattribute__": h.guarded_getattribute})


def guard_module_of(h, filename) -> None:
    """The test module of ``filename`` is about to run its code: guarded before anything it imports can
    reach into it (its globals: the assertion helpers, ``pytest``, the names it imported)."""
    for module in list(h.modules.values()):
        if type(module) is ModuleType and h.module_dict(module).get("__file__") == filename:
            module.__class__ = h.Guarded


def test_globals(h) -> str:
    """A test module's globals changed since collection, or its assertion helpers are not pytest's."""
    import builtins

    import _pytest.assertion.rewrite

    for module, kept in h.test_modules:
        now = h.module_dict(module)
        if (
            now.get("@pytest_ar", _pytest.assertion.rewrite) is not _pytest.assertion.rewrite
            or now.get("@py_builtins", builtins) is not builtins
        ):
            return f"the assertion helpers of {kept.get('__name__')} are not pytest's"
        changed = [name for name, value in kept.items() if now.get(name, MISSING) is not value]
        added = [name for name in now if name not in kept and name != "__warningregistry__"]  # (warnings' own)
        if changed or added:
            return f"the globals of the test module {kept.get('__name__')} changed: {', '.join((changed + added)[:3])}"
    return ""


def item_origins(h, items) -> str:
    """A collected test whose function is untrusted code (a module the code under test planted in
    sys.modules, or a finder of its own, stood in for a test module). Decorated tests
    (``unittest.skip``, ``mock.patch``) are the decorator's trusted code."""
    for item in items:
        if untrusted_obj(h, getattr(item, "obj", None)):
            return f"the test {item.nodeid} is untrusted code"
    return ""


def importers(h) -> str:
    """An import finder or path hook of untrusted code."""
    for finder in [*sys.meta_path, *sys.path_hooks]:
        method = finder if callable(finder) and not isinstance(finder, type) else None
        method = getattr(finder, "find_spec", None) or getattr(finder, "find_module", None) or method
        if code_of(h, method) is not None and untrusted_obj(h, method):
            return f"an import finder of untrusted code ({type(finder).__name__})"
    return ""


def on_enter(h, item) -> None:
    kept = h.items.get(item.nodeid)
    if kept is None or kept[0] is not item or _function(item.obj) is not kept[1] or "runtest" in vars(item):
        note(h, f"the test item {item.nodeid} was changed")
    elif _params(item) != kept[2]:
        note(h, f"the parameters of {item.nodeid} were changed")
    problem = wrappers_intact(h) or look(h, during_test=False)[0] or test_globals(h)
    if problem:
        note(h, problem)
    h.finalizers_before = {id(f): f for f in finalizers(h, item)}  # (kept alive: an id is never another's)
    h.current = item
    h.clear_lines()


def on_outcome(h, item, outcome) -> None:
    problem = integrity(h, h.machinery) or machinery_state(h, item.config) or wrappers_intact(h)
    problem = problem or test_globals(h) or new_finalizers(h, item)
    tampering, unchecked = look(h, during_test=True)
    problem = problem or tampering
    if problem:
        note(h, problem)
    if item.nodeid in h.outcomes:
        note(h, f"{item.nodeid} reported twice")
    if type(item) is h.items_types[0] and item.nodeid not in h.called:
        unchecked = unchecked or "the runner never called the test function"
    unchecked = unchecked or h.unverified.get(item.nodeid, "")
    if unchecked and outcome == "passed":
        on_note(h, f"{item.nodeid} counts as failed: {unchecked}")
    h.outcomes[item.nodeid] = outcome = outcome if not (problem or unchecked) else "failed"
    h.current = None
    emit(h, "outcome", item.nodeid, outcome)


def on_calling(h, item) -> None:
    """The runner's ``pytest_pyfunc_call`` is about to call the test function (the one collected)."""
    kept = h.items.get(item.nodeid)
    if kept is None or _function(item.obj) is not kept[1]:
        note(h, f"the test function of {item.nodeid} was changed")
    h.called.add(item.nodeid)


def on_failed(h, nodeid) -> None:
    h.failed.add(nodeid)
    emit(h, "failed", nodeid)


def on_check(h, item) -> None:
    problem = integrity(h, h.machinery) or machinery_state(h, item.config) or module_files(h) or wrappers_intact(h)
    problem = problem or test_globals(h)
    if problem:
        note(h, problem)


def on_note(h, text) -> None:
    if len(h.notes) < 20:
        h.notes.append(str(text)[:200])
        emit(h, "note", h.notes[-1])


def on_finish(h, code, log) -> None:
    problem = integrity(h, h.machinery) or integrity(h, list(h.snapshot[0]), strict=False)
    problem = problem or module_files(h) or wrappers_intact(h)
    if problem:
        note(h, problem)
    emit(h, "finish", str(code), log if type(log) is str else "")


ON = {"collected": on_collected, "enter": on_enter, "calling": on_calling, "outcome": on_outcome,
      "failed": on_failed, "check": on_check, "note": on_note, "finish": on_finish}  # fmt: skip


# ---------------------------------------------------------------------- integrity
def integrity(h, names, accept: bool = False, strict: bool = True) -> str:
    """The first attribute of the modules ``names`` (or their classes) changed since the snapshot.
    None -> a value is lazy initialization; ``accept`` (when collection ends) holds functions of
    trusted code pytest's plugins set; not ``strict``, only a value of untrusted code counts."""
    modules, classes = h.snapshot
    for name in names:
        module, before = modules[name]
        if h.modules.get(name) is not module:
            return f"sys.modules[{name!r}] was replaced"
        containers = [(name, h.module_dict(module), before)]  # (not through a guarded module's __getattribute__)
        containers += [(f"{name}.{cls.__name__}", cls.__dict__, attrs) for cls, attrs in classes.get(name, ())]
        for where, now, attrs in containers:
            for attr, value in attrs.items():
                current = now.get(attr, MISSING)
                if current is value or value is None or h.accepted.get((id(attrs), attr), MISSING) is current:
                    continue
                if accept and type(current) is FunctionType and not untrusted_obj(h, current):
                    h.accepted[(id(attrs), attr)] = current
                    continue
                if strict or untrusted_value(h, current):
                    return f"{where}.{attr} was changed"
    return ""


def untrusted_value(h, value, depth: int = 0) -> bool:
    """Code of untrusted code: a function or method, a partial of one, a class defining one, or an
    instance of such a class."""
    kind = type(value)
    if kind in CODE_OF or kind is MethodType:
        return code_of(h, value) is not None and untrusted_obj(h, value)
    if kind is Partial and depth < 3:
        return untrusted_value(h, value.func, depth + 1)
    cls = value if isinstance(value, type) else kind
    return depth < 3 and any(
        type(member) is FunctionType and untrusted_obj(h, member) for member in list(h.type_dict(cls).values())
    )


def machinery_state(h, config) -> str:
    if set(config.pluginmanager.get_plugins()) != h.state.get("plugins"):
        return "pytest's plugins changed"
    now, kept = hook_state(config), h.state.get("hooks", [])
    if len(now) != len(kept) or any(a is not b for a, b in zip(now, kept)):
        return "pytest's hook callers or implementations changed"
    for s, handler in h.handlers.items():
        if h.getsignal(s) is not handler:
            return f"the handler of signal {s} changed"
    if linecache.__dict__.get("cache") is not h.line_cache or type(h.line_cache) is not dict:
        return "linecache's cache was replaced"
    hooks = callback_hooks()
    if any(a is not b for a, b in zip(hooks, h.state.get("callbacks", hooks))):
        return "a hook of sys or threading changed (excepthook, unraisablehook, displayhook, breakpointhook)"
    if list(h.gc_callbacks) != h.state.get("gc", []):
        return "gc.callbacks changed"
    return ""


def hook_state(config) -> list:
    """What decides which code pytest's hooks run, as objects compared by identity: the hook relay, the
    manager's executor, and for each hook its caller, executor, implementation list and spec, and each
    implementation's slots (its function, plugin and order)."""
    manager = config.pluginmanager
    out = [config.hook, manager._inner_hookexec]
    for name in HOOKS:
        caller = getattr(config.hook, name)
        out += [caller, caller._hookexec, caller._hookimpls, caller.spec, *caller._hookimpls]
        for impl in caller._hookimpls:
            out += [impl.function, impl.plugin, impl.wrapper, impl.hookwrapper, impl.tryfirst, impl.trylast,
                    impl.argnames, impl.kwargnames]  # fmt: skip
    return out


def callback_hooks() -> list:
    import threading

    return [sys.excepthook, sys.unraisablehook, sys.displayhook, sys.breakpointhook, threading.excepthook]


def finalizers(h, item) -> list:
    """The callables pytest will run at teardown, and the pending ``weakref.finalize`` ones."""
    stack = getattr(getattr(item.session, "_setupstate", None), "stack", None) or {}
    out = [f for finals, _ in list(stack.values()) for f in list(finals)]
    return out + [info.func for info in list(h.weak_registry.values())]


def new_finalizers(h, item) -> str:
    """A finalizer added while the test ran that is not a function of the tests or of pytest (a chain of
    C callables runs later with no untrusted code on the stack: ``partial(list.extend, map(...))``)."""
    for function in finalizers(h, item):
        if id(function) in h.finalizers_before:
            continue
        code = code_of(h, function.func if type(function) is Partial else function)
        if code is None or not (code.co_filename in h.test_files or code.co_filename.startswith(h.machinery_roots)):
            return f"{item.nodeid} left a finalizer that is not the tests' or pytest's"
    return ""


def plugin_origins(h, config) -> str:
    """A hook implementation of untrusted code (a plugin the code under test registered)."""
    for hook_name in HOOKS:
        for impl in getattr(config.hook, hook_name).get_hookimpls():
            if untrusted_obj(h, impl.function):
                return f"a {hook_name} implementation of untrusted code ({impl.plugin_name})"
    return ""


def module_files(h) -> str:
    """A module of the repository registered under another module's name (a package that swaps the
    tested module in sys.modules)."""
    for name, module in list(h.modules.items()):
        expected = [h.workspace + "/" + name.replace(".", "/") + tail for tail in (".py", "/__init__.py")]
        if not any(path in h.base for path in expected):
            continue
        found = getattr(module, "__file__", None) if type(module) in (ModuleType, h.Guarded) else None
        if found not in expected and (type(found) is not str or untrusted(h, found)):  # (tlz aliases toolz)
            return f"sys.modules[{name!r}] is not the repository's {name}"
    return ""


def _function(obj):
    """A bound method's function (a unittest test's method is bound anew to each test's instance)."""
    return obj.__func__ if type(obj) is MethodType else obj


def _params(item) -> str:
    """A parametrized test's parameters, as text (changed in place or replaced, they differ)."""
    callspec = getattr(item, "callspec", None)
    return repr(sorted(callspec.params.items(), key=lambda kv: kv[0])) if callspec is not None else ""


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
