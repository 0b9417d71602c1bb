"""The harness's comparison checks (run with ``harness.py`` and ``harness_checks.py``, in their namespace:
the design is in ``runner.py``'s docstring): every class's ``__eq__``/``__ne__`` that is not a
library's own is wrapped and checked as it runs, and assertions check their operands."""

import builtins
import os
import sys
import unittest

COMPARISONS = ("__eq__", "__ne__")
PLAIN = frozenset({str, bytes, int, float, complex, bool, type(None), tuple, list, dict, set, frozenset})
"""Values whose equality is the interpreter's (a container's items are checked as objects of their own)."""
WRAPPERS = '''
def make_comparison(descriptor, equal, name, mutate, urandom, audit, NI, call, base, plain, kind, error=Exception):
    """A class's own comparison, checked as it runs. The answer is judged here (a bool is returned: an
    answer object cannot change its mind later). A class of a plain built-in type (a ``str``
    subclass) must agree with that type about a plain value: saying "equal" where ``str`` says not is
    tampering. Any class is also asked about values it could not know (the other value changed; a fresh
    object), once or twice before and after the real question, in an order it cannot foresee."""

    def compare(self, other, _d=descriptor, _e=equal, _n=name, _m=mutate, _u=urandom, _a=audit, _NI=NI, _c=call,
                _b=base, _p=plain, _k=kind, _X=error):
        bits = _u(1)[0]
        asked, real, claimed, result = 3 + (bits & 1) + (bits >> 1 & 1), 1 + (bits & 1), False, _NI
        while asked:  # decoys, the real question (after one or two), decoys
            asked -= 1
            if asked == real:
                result = _c(_d, self, other)
                if result is not _NI:
                    result = not not result
                    truth = _b(self, other) if _b is not None and _k(other) in _p else _NI
                    claimed = claimed or (truth is not _NI and result is _e and truth is not _e)
                continue
            decoy = _m(other, _u)
            try:  # (an honest comparison may refuse a value it was not made for)
                answer = _c(_d, self, decoy)
            except _X:
                answer = _NI
            said = answer is not _NI and (not not answer) is _e
            claimed = claimed or (said and (_b is None or _b(self, decoy) is not _e))
        if claimed:
            _a("lit_marl.equal", _n)
        return result

    return compare


def mutate(value, urandom, _t=type, _s=str, _b=bytes, _i=int, _f=float, _tu=tuple, _l=list, _o=object, _n=len):
    kind = _t(value)
    if kind is _s and value:
        at = urandom(1)[0] % _n(value)  # one character becomes a control picture (U+2400..): no honest
        other = "\u2400\u2401\u2402\u2403"[urandom(1)[0] & 3]  # value equals the result by chance
        return value[:at] + (other if value[at] != other else "\u2404") + value[at + 1 :]
    if kind is _b and value:
        at = urandom(1)[0] % _n(value)
        return value[:at] + (b"\\xfe" if value[at : at + 1] != b"\\xfe" else b"\\xfd") + value[at + 1 :]
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
        audit("lit_marl.class", made, func)
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
             "object": object, "getattr": getattr, "len": len, "Exception": Exception}  # fmt: skip
    namespace = {"__builtins__": names}  # read while the definitions run, then emptied: no name is looked up later
    with open(HARNESS_FILES[-1]) as handle:  # compiled at their own lines: tracebacks show them
        lines = handle.read().split("WRAPPERS = " + "'" * 3)[0].count("\n")
    exec(compile("\n" * lines + WRAPPERS, HARNESS_FILES[-1], "exec"), namespace)
    names.clear()
    namespace["call"].__defaults__ = (type, FunctionType, getattr)
    h.urandom, h.type_dict, h.type_mro = os.urandom, type.__dict__["__dict__"].__get__, type.__dict__["__mro__"].__get__
    h.subclasses, h.type_setattr, h.FunctionType = type.__subclasses__, type.__setattr__, FunctionType
    h.module_dict = ModuleType.__dict__["__dict__"].__get__
    h.make_comparison, h.mutate, h.call = namespace["make_comparison"], namespace["mutate"], namespace["call"]
    classes = all_classes(h)  # known by their ids (a metaclass decides == and hash), kept alive in h.known
    h.known, h.library = {id(cls): (cls, comparisons(h, cls)) for cls in classes}, set(map(id, classes))
    h.equal_verdicts = {}  # id of a library class's __eq__ -> whether its instances equal anything
    import gc
    import weakref

    h.gc_callbacks, h.weak_registry = gc.callbacks, weakref.finalize._registry
    h.called, h.unverified, h.test_modules, h.finalizers_before = set(), {}, [], {}
    h.machinery_roots = tuple(
        os.path.dirname(m.__file__) + "/" for m in (sys.modules["_pytest"], sys.modules["pluggy"], unittest)
    )
    h.build_class = namespace["make_build_class"](builtins.__build_class__, sys.audit)
    h.build_class_code, h.trusted_classes, h.repository_classes = h.build_class.__code__, set(), set()
    h.function_dict = FunctionType.__dict__["__dict__"].__get__
    h.dict_offset = type.__dict__["__dictoffset__"].__get__
    h.build_cells = [cell.cell_contents for cell in h.build_class.__closure__]
    builtins.__build_class__ = h.build_class
    h.assert_equal = namespace["make_assert_equal"](unittest.TestCase.assertEqual, sys.audit)
    h.assert_cells = [cell.cell_contents for cell in h.assert_equal.__closure__]
    h.assert_names = [n for n in ("assertEqual", "assertEquals", "failUnlessEqual") if n in unittest.TestCase.__dict__]
    for name in h.assert_names:  # (the deprecated aliases hold the original: they would not check)
        setattr(unittest.TestCase, name, h.assert_equal)
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


def new_class(h, cls, body=None) -> None:
    """A class statement just ran (``builtins.__build_class__``): its comparisons are wrapped at once.
    A class whose body is trusted code (the repository's, a library's) and whose metaclass is a
    library's or such a class is trusted: its own trusted functions stay as they are (a decorated
    ``__eq__`` too). Asked by the wrapper's own code only; anyone else's asking is a look."""
    if not any(c is type for c in h.type_mro(type(cls))):
        return
    caller = stack(h, 5, limit=1)  # stack, new_class, running, own, hook, then the one who asked
    body_code = code_of(h, body)
    if caller and caller[0][3] is h.build_class_code and body_code is not None:
        if not untrusted_code(h, body_code):
            if all(id(c) in h.library or id(c) in h.trusted_classes for c in h.type_mro(type(cls))):
                h.trusted_classes.add(id(cls))
        elif body_code.co_filename in h.changed_lines and body_code.co_firstlineno not in h.changed_lines.get(
            body_code.co_filename, ()
        ):  # (a file of the base commit the agent changed; the class's own line is the repository's)
            h.repository_classes.add(id(cls))  # a class of the repository whose body the agent changed
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
                return f"{cls.__qualname__} made bare, claims to equal anything", ""
            if any(value is not MISSING and untrusted_value(h, value) for value in now):
                unchecked = unchecked or f"{cls.__qualname__} got a comparison while the test ran, too late to check"
    return "", unchecked


def look_at(h, cls) -> list:
    """Wrap ``cls``'s comparisons that are not the libraries' own (untrusted code, or anything that is
    not a function: a ``partialmethod``, a builtin) and an inherited ``__eq__`` of an always-equal
    class; remember what they are now. The names wrapped."""
    own, done, first = h.type_dict(cls), [], id(cls) not in h.known
    for name in COMPARISONS:
        value = own.get(name, MISSING)
        if value is MISSING:
            owner = next((c for c in h.type_mro(cls) if name in h.type_dict(c)), None)
            value = h.type_dict(owner)[name] if owner is not None else None
            if name != "__eq__" or id(owner) not in h.library or not library_equals_anything(h, owner, value):
                continue
        elif value is None or id(value) in h.own_ids:
            continue
        elif (
            type(value) is h.FunctionType
            and not untrusted_obj(h, value)
            and ((first and id(cls) in h.trusted_classes) or own_function(h, cls, value, name))
        ):
            continue  # a trusted class's own as it was made, or defined in the class's body under this name
        base = next((c for c in h.type_mro(cls) if c in PLAIN), None)
        wrapper = h.make_comparison(value, name == "__eq__", cls.__qualname__, h.mutate, h.urandom, sys.audit,
                                    NotImplemented, h.call, None if base is None else h.type_dict(base)[name],
                                    PLAIN, type)  # fmt: skip
        try:
            h.type_setattr(cls, name, wrapper)
        except (TypeError, AttributeError):
            continue
        h.own_ids.add(id(wrapper))
        done.append(name)
    h.known[id(cls)] = (cls, comparisons(h, cls))  # (the class kept alive: its id is never another's)
    return done


def own_function(h, cls, function, name) -> bool:
    """``function`` was defined as ``name`` in ``cls``'s own body, perhaps decorated: its qualified name
    and module are the class's, and its code (or the code of a function it wraps, ``functools.wraps``'s
    ``__wrapped__``) is named so (a code's name nothing may change)."""
    qualname, module = getattr(function, "__qualname__", ""), getattr(function, "__module__", None)
    if type(qualname) is not str or not qualname.startswith(cls.__qualname__ + ".") or module != cls.__module__:
        return False
    for _ in range(4):
        code = code_of(h, function)
        if code is not None and code.co_name == name:
            return True
        function = h.function_dict(function).get("__wrapped__") if type(function) is h.FunctionType else None
    return False


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
    note(h, f"{name} said it equals a value it could not know")


def compared(h, op, left, right) -> None:
    """An assertion's operands (pytest's ``assert a == b``, also one that passed; ``TestCase.assertEqual``),
    where one is not a plain value and its ``__eq__`` is not the repository's own:

    - against a plain value, an object of a plain type (a ``str`` subclass) decides by that type's
      answer, and an object whose comparison is the agent's decides nothing: otherwise the test counts
      as failed (values a wrapper asks about can be told from the real one: by a reference count);
    - any other such object must not equal a fresh object (``unittest.mock.ANY``, a mock told to
      equal): tampering, unless it is a library's and the test names it."""
    if op != "==":
        return
    for this, other in ((left, right), (right, left)):
        cls = type(this)
        owner = None if cls in PLAIN else next((c for c in h.type_mro(cls) if "__eq__" in h.type_dict(c)), None)
        kind = "" if owner is None else comparison_kind(h, owner, h.type_dict(owner)["__eq__"])
        if kind in ("", "tests"):
            continue
        if type(other) in PLAIN:
            base = next((c for c in h.type_mro(cls) if c in PLAIN), None)
            if base is None and not settled_value(h, this, cls, kind):
                if equals_anything(h, this, owner):
                    return
                why = f"{cls.__qualname__} decided an assertion against a plain value by its own comparison"
                h.unverified.setdefault(getattr(h.current, "nodeid", ""), why)
                continue
            if base is not None:
                if h.type_dict(base)["__eq__"](this, other) is not True:
                    why = f"{cls.__qualname__} said it equals a value its type ({base.__name__}) says it does not"
                    h.unverified.setdefault(getattr(h.current, "nodeid", ""), why)
                continue
        if kind != "repository" and equals_anything(h, this, owner):
            return


def equals_anything(h, this, owner) -> bool:
    """``this`` equals a fresh object: tampering (noted), unless a library's and named by the test
    (``assert value == mock.ANY``); whether it does."""
    try:
        claims = bool(this == object())
    except Exception:
        claims = False
    if claims and not (id(owner) in h.library and named_by_the_test(h, this)):
        note(h, f"an object that equals anything ({type(this).__qualname__}) was compared in a test")
    return claims


def settled_value(h, this, cls, kind: str) -> bool:
    """An object may decide an assertion against a plain value by its own comparison: the comparison
    is not the agent's, its classes are a library's or the repository's (as made: a class statement
    of the repository, not one the agent added nor one made at run time), and nothing on the object
    itself shadows what those classes define or is the agent's code (``UserList``'s ``__cast``, set
    on an instance, would decide)."""
    known = (h.library, h.trusted_classes, h.repository_classes)
    if kind == "agent" or not all(any(id(c) in ids for ids in known) for c in h.type_mro(cls)):
        return False
    if not h.dict_offset(cls):
        return True
    try:
        own = object.__getattribute__(this, "__dict__")
    except Exception:
        return False
    names = {name for c in h.type_mro(cls) for name in h.type_dict(c)}
    return type(own) is dict and not any(
        type(name) is not str or name in names or untrusted_value(h, value) for name, value in list(own.items())
    )


def comparison_kind(h, owner, value) -> str:
    """Whose ``__eq__`` ``value`` (defined by the class ``owner``) is: ``agent`` (untrusted code, or one
    the harness wrapped: not a library's own), ``repository`` (trusted code of the workspace: the repository's or its
    tests' own classes), ``library``."""
    code = code_of(h, value)
    if id(value) in h.own_ids or (code is not None and untrusted_code(h, code)):
        return "agent"
    if code is not None and code.co_filename in h.test_files and id(owner) in h.trusted_classes:
        return "tests"  # the tests' own helpers (toolz's AlwaysEquals): the tests' to use
    if code is not None and code.co_filename.startswith(h.workspace + "/") and id(owner) in h.trusted_classes:
        return "repository"
    return "library"


def named_by_the_test(h, value) -> bool:
    """The running test's code names a module attribute that holds ``value`` (``ANY``)."""
    code = code_of(h, _function(h.current.obj)) if h.current is not None else None
    return code is not None and bool(names_of(code) & names_bound_to(h, value))


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
    if any(unittest.TestCase.__dict__.get(name) is not h.assert_equal for name in h.assert_names):
        return "unittest.TestCase.assertEqual was replaced"
    for made, cells in ((h.build_class, h.build_cells), (h.assert_equal, h.assert_cells)):
        if any(cell.cell_contents is not kept for cell, kept in zip(made.__closure__, cells)):
            return "the harness's wrappers were changed"
    return ""
