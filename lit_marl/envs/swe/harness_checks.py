"""The harness's checks and the runner's events (run with ``harness.py``, in its namespace: the design
is in ``runner.py``'s docstring). Every function takes the verdict's state ``h``."""

import builtins
import os
import sys
import unittest

MISSING = object()
HOOKS = ("pytest_runtest_call", "pytest_runtest_protocol", "pytest_runtest_makereport", "pytest_pyfunc_call",
         "pytest_runtest_setup", "pytest_runtest_teardown", "pytest_runtest_logreport", "pytest_assertrepr_compare",
         "pytest_assertion_pass")  # fmt: skip
COMPARISONS = ("__eq__", "__ne__")
PLAIN = frozenset({str, bytes, int, float, complex, bool, type(None), tuple, list, dict, set, frozenset})
"""Values whose equality is the interpreter's (a container's items are checked as objects of their own)."""
WRAPPERS = '''
def make_comparison(descriptor, equal, name, mutate, urandom, audit, NI, call):
    """A class's own comparison, checked as it runs: the other value is also replaced by values the
    object could not know (the other one changed: a longer string, a larger number, a longer tuple; or
    a fresh object), asked once or twice before and after the real question, in an order the object
    cannot foresee. An object that claims to equal one of them claims to equal anything."""

    def compare(self, other, _d=descriptor, _e=equal, _n=name, _m=mutate, _u=urandom, _a=audit, _NI=NI, _c=call):
        bits = _u(1)[0]
        before, after, claimed = 1 + (bits & 1), 1 + (bits >> 1 & 1), False
        while before:
            answer = _c(_d, self, _m(other, _u))
            claimed = claimed or (answer is not _NI and (not not answer) is _e)
            before -= 1
        result = _c(_d, self, other)
        while after:
            answer = _c(_d, self, _m(other, _u))
            claimed = claimed or (answer is not _NI and (not not answer) is _e)
            after -= 1
        if claimed:
            _a("lit_marl.equal", _n)
        return result

    return compare


def mutate(value, urandom, _t=type, _s=str, _b=bytes, _i=int, _f=float, _tu=tuple, _l=list, _o=object):
    kind = _t(value)
    if kind is _s:
        return value + "\\x00" + urandom(6).hex()
    if kind is _b:
        return value + b"\\x00" + urandom(6)
    if kind is _i:
        return value + 1 + urandom(1)[0]
    if kind is _f and value - value == 0.0:
        return value + 1.0 + urandom(1)[0]
    if kind is _tu:
        return value + (_o(),)
    if kind is _l:
        return value + [_o()]
    return _o()


def call(descriptor, self, other, _t=type, _F=None, _ga=getattr):
    if _t(descriptor) is _F:
        return descriptor(self, other)
    get = _ga(_t(descriptor), "__get__", None)
    return get(descriptor, self, _t(self))(other) if get is not None else descriptor(other)


def make_build_class(build, audit):
    def build_class(func, name, *bases, **keywords):
        made = build(func, name, *bases, **keywords)
        audit("lit_marl.class", made)
        return made

    return build_class


def make_assert_equal(original, audit):
    def assertEqual(self, first, second, msg=None):
        audit("lit_marl.compared", "==", first, second)
        return original(self, first, second, msg)

    return assertEqual
'''
"""Functions the code under test can reach (on its classes, in ``builtins``, on ``TestCase``), so
compiled in a namespace of their own with no builtins: they read no global, and what they call is
bound as defaults (setting ``__defaults__`` of the harness's functions is refused) or in closures
(checked after every test)."""


def prepare_equality(h) -> None:
    """Before the snapshot: the trusted classes whose instances equal anything (``unittest.mock.ANY``),
    the wrappers, ``builtins.__build_class__`` (every class statement is seen as it is made) and
    ``TestCase.assertEqual`` (its operands are checked as an assertion's are)."""
    FunctionType = type(prepare_equality)
    names = {"type": type, "str": str, "bytes": bytes, "int": int, "float": float, "tuple": tuple, "list": list,
             "object": object, "getattr": getattr}  # fmt: skip
    namespace = {"__builtins__": names}  # read while the definitions run, then emptied: no name is looked up later
    exec(compile(WRAPPERS, CHECKS_FILE, "exec"), namespace)
    names.clear()
    namespace["call"].__defaults__ = (type, FunctionType, getattr)
    h.urandom, h.type_dict, h.type_mro = os.urandom, type.__dict__["__dict__"].__get__, type.__dict__["__mro__"].__get__
    h.subclasses, h.type_setattr, h.FunctionType = type.__subclasses__, type.__setattr__, FunctionType
    h.module_dict = ModuleType.__dict__["__dict__"].__get__
    h.make_comparison, h.mutate, h.call = namespace["make_comparison"], namespace["mutate"], namespace["call"]
    classes = all_classes(h)  # known by their ids (a metaclass decides == and hash), kept alive in h.known
    h.known, h.wrapped, h.library = {id(cls): (cls, comparisons(h, cls)) for cls in classes}, {}, set(map(id, classes))
    h.equal_verdicts = {}  # id of a library class's __eq__ -> whether its instances equal anything
    h.build_class = namespace["make_build_class"](builtins.__build_class__, sys.audit)
    h.build_cells = [cell.cell_contents for cell in h.build_class.__closure__]
    builtins.__build_class__ = h.build_class
    h.assert_equal = namespace["make_assert_equal"](unittest.TestCase.assertEqual, sys.audit)
    h.assert_cells = [cell.cell_contents for cell in h.assert_equal.__closure__]
    unittest.TestCase.assertEqual = h.assert_equal
    h.own_ids = {id(f) for f in (*namespace.values(), h.build_class, h.assert_equal) if type(f) is FunctionType}


def all_classes(h) -> list:
    """Every class there is, found from ``object`` down (``type.__subclasses__``, not the classes' own)."""
    out, todo, seen = [], [object], {id(object)}
    while todo:
        cls = todo.pop()
        out.append(cls)
        for sub in h.subclasses(cls):
            if id(sub) not in seen:
                seen.add(id(sub))
                todo.append(sub)
    return out


def library_equals_anything(h, cls, function) -> bool:
    """Whether ``function``, the ``__eq__`` a library class ``cls`` defines, says its instances equal
    two values they cannot know (``unittest.mock.ANY``'s class); asked once per function, on an
    instance made bare."""
    verdict = h.equal_verdicts.get(id(function))
    if verdict is None:
        instance = bare(h, cls) if type(function) is h.FunctionType else None
        verdict = instance is not None
        for probe in (object(), h.urandom(8).hex()) if verdict else ():
            try:
                answer = function(instance, probe)
                verdict = verdict and answer is not NotImplemented and bool(answer)
            except Exception:
                verdict = False
        h.equal_verdicts[id(function)] = verdict  # (a library class's function: alive, its id never another's)
    return verdict


def bare(h, cls):
    """An instance of ``cls`` made without running any of its code (its first built-in base's
    ``__new__``); None when there is none."""
    for base in h.type_mro(cls):
        if type(h.type_dict(base).get("__new__")) is staticmethod or base.__module__ != "builtins":
            continue
        try:
            return base.__new__(cls)
        except Exception:
            return None
    return None


def new_class(h, cls) -> None:
    """A class statement just ran (``builtins.__build_class__``): its comparisons are wrapped at once.
    (Comparisons of trusted code that came too late are checked where an assertion compares.)"""
    if any(c is type for c in h.type_mro(type(cls))):
        look_at(h, cls)


def comparisons(h, cls) -> tuple:
    own = h.type_dict(cls)
    return own.get("__eq__", MISSING), own.get("__ne__", MISSING)


def look(h, during_test: bool) -> tuple[str, str]:
    """Every class's comparisons against what they were at the last look (``h.known``): new ones are
    wrapped. ``during_test`` (after a test): a comparison that came while the test ran other than by
    a class statement (``type()`` called with one, one set on a class) was not wrapped in time, so the
    test it may have decided does not count: (tampering, why the test fails) — tampering when its
    objects, made bare, claim to equal values they cannot know."""
    unchecked = ""
    for cls in all_classes(h):
        before, now = h.known.get(id(cls), (None, (None, None)))[1], comparisons(h, cls)
        if before[0] is now[0] and before[1] is now[1]:
            continue
        if look_at(h, cls) and during_test:
            if claims_on_bare(h, cls):
                return f"{cls.__qualname__} claims to equal anything", ""
            if any(value is not MISSING and untrusted_value(h, value) for value in now):
                unchecked = unchecked or f"{cls.__qualname__} got a comparison while the test ran, too late to check"
    return "", unchecked


def look_at(h, cls) -> list:
    """Wrap ``cls``'s comparisons that are not the libraries' own (untrusted code, or anything that is
    not a function: a ``partialmethod``, a builtin) and an inherited ``__eq__`` of an always-equal
    class; remember what they are now. The names wrapped."""
    own, done = h.type_dict(cls), []
    for name in COMPARISONS:
        value = own.get(name, MISSING)
        if value is MISSING:
            owner = next((c for c in h.type_mro(cls) if name in h.type_dict(c)), None)
            value = h.type_dict(owner)[name] if owner is not None else None
            if name != "__eq__" or id(owner) not in h.library or not library_equals_anything(h, owner, value):
                continue
        elif value is None or id(value) in h.own_ids:
            continue
        elif type(value) is h.FunctionType and not untrusted_obj(h, value):
            continue
        wrapper = h.make_comparison(value, name == "__eq__", cls.__qualname__, h.mutate, h.urandom, sys.audit,
                                    NotImplemented, h.call)  # fmt: skip
        try:
            h.type_setattr(cls, name, wrapper)
        except (TypeError, AttributeError):
            continue
        h.own_ids.add(id(wrapper))
        h.wrapped[(id(cls), name)] = (cls, wrapper)
        done.append(name)
    h.known[id(cls)] = (cls, comparisons(h, cls))  # (the class kept alive: its id is never another's)
    return done


def claims_on_bare(h, cls) -> bool:
    instance = bare(h, cls)
    if instance is None:
        return False
    for probe in (object(), h.urandom(8).hex(), sys.intern("x" + h.urandom(4).hex()), 1 + h.urandom(1)[0], (object(),)):
        try:
            if instance == probe or not (instance != probe):
                return True
        except Exception:
            continue
    return False


def claimed_equal(h, name) -> None:
    note(h, f"{name} claims to equal anything")


def compared(h, op, left, right) -> None:
    """An assertion's operands (pytest's ``assert a == b``, also one that passed; ``TestCase.assertEqual``):
    an operand that is not a plain built-in value must not equal the other one changed, nor a fresh
    object (``unittest.mock.ANY``, a mock told to equal, a comparison set on a library class). An
    always-equal object of a library counts only where the test names it."""
    if op != "==":
        return
    for this, other in ((left, right), (right, left)):
        if type(this) in PLAIN:
            continue
        try:
            claims = bool(this == h.mutate(other, h.urandom)) or bool(this == object())
        except Exception:
            claims = False
        if not claims:
            continue
        item = h.current
        code = code_of(h, _function(item.obj)) if item is not None else None
        named = id(type(this)) in h.library and code is not None and names_of(code) & names_bound_to(h, this)
        if not named:
            note(h, f"an object that equals anything ({type(this).__qualname__}) was compared in a test")
            return


def names_bound_to(h, value) -> set:
    """The module attributes that hold ``value`` (``ANY`` for ``unittest.mock.ANY``)."""
    return {
        name
        for module in list(h.modules.values())
        if type(module) is ModuleType
        for name, held in list(h.module_dict(module).items())
        if held is value
    }


def names_of(code) -> set:
    names, todo = set(), [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo += [c for c in current.co_consts if type(c) is type(code)]
    return names


def wrappers_intact(h) -> str:
    if builtins.__dict__.get("__build_class__") is not h.build_class:
        return "builtins.__build_class__ was replaced"
    if unittest.TestCase.__dict__.get("assertEqual") is not h.assert_equal:
        return "unittest.TestCase.assertEqual was replaced"
    for made, cells in ((h.build_class, h.build_cells), (h.assert_equal, h.assert_cells)):
        if any(cell.cell_contents is not kept for cell, kept in zip(made.__closure__, cells)):
            return "the harness's wrappers were changed"
    for (_, name), (cls, wrapper) in h.wrapped.items():
        if h.type_dict(cls).get(name) is not wrapper:
            return f"{cls.__qualname__}.{name} was replaced after it was checked"
    return ""


# ---------------------------------------------------------------------- the runner's events
def on_collected(h, session) -> None:
    problem = integrity(h, h.machinery, accept=True)
    config = session.config
    h.handlers.update({s: h.getsignal(s) for s in h.signals})
    h.state["plugins"] = set(config.pluginmanager.get_plugins())
    h.state["impls"] = {name: list(getattr(config.hook, name).get_hookimpls()) for name in HOOKS}
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
    for finder in sys.meta_path:  # pytest's assertion rewriter holds the session (and with it every item)
        cls = type(finder)
        if hasattr(finder, "session") and "__getattribute__" not in vars(cls):
            finder.__class__ = type("Guarded" + cls.__name__, (cls,), {"__getattribute__": h.guarded_getattribute})


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
    problem = wrappers_intact(h) or look(h, during_test=False)[0]
    if problem:
        note(h, problem)
    h.current = item
    h.clear_lines()


def on_outcome(h, item, outcome) -> None:
    problem = integrity(h, h.machinery) or machinery_state(h, item.config) or wrappers_intact(h)
    tampering, unchecked = look(h, during_test=True)
    problem = problem or tampering
    if problem:
        note(h, problem)
    if item.nodeid in h.outcomes:
        note(h, f"{item.nodeid} reported twice")
    if unchecked and outcome == "passed":
        on_note(h, f"{item.nodeid} counts as failed: {unchecked}")
    h.outcomes[item.nodeid] = outcome = outcome if not (problem or unchecked) else "failed"
    h.current = None
    emit(h, "outcome", item.nodeid, outcome)


def on_failed(h, nodeid) -> None:
    h.failed.add(nodeid)
    emit(h, "failed", nodeid)


def on_check(h, item) -> None:
    problem = integrity(h, h.machinery) or machinery_state(h, item.config) or module_files(h) or wrappers_intact(h)
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


ON = {"collected": on_collected, "enter": on_enter, "outcome": on_outcome, "failed": on_failed, "check": on_check,
      "note": on_note, "finish": on_finish}  # fmt: skip


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
    for hook_name, impls in h.state.get("impls", {}).items():
        if list(getattr(config.hook, hook_name).get_hookimpls()) != impls:
            return f"pytest's {hook_name} implementations changed"
    for s, handler in h.handlers.items():
        if h.getsignal(s) is not handler:
            return f"the handler of signal {s} changed"
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
