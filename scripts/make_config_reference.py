"""Writes docs/config.md, the configuration reference, from the typed ``__init__`` arguments.

One section per class a config names - algorithms (``model``), data modules (``data``), environments
(``data.init_args.env``: a class, or a registered name), callbacks, strategies - and per settings
dataclass in their argument types. A class's arguments are those LightningCLI accepts: its
``__init__``'s, then, while an ``__init__`` passes ``**kwargs`` on to ``super().__init__``, its bases'
(less the keywords it fixes there). Descriptions come from the ``Args:`` block of the ``__init__``
docstring (a dataclass: the docstring under each field). tests/configs/test_docs.py keeps the file
equal to this output.

    .venv/bin/python scripts/make_config_reference.py           # rewrite docs/config.md
    .venv/bin/python scripts/make_config_reference.py --check   # exit 1 if docs/config.md is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import pkgutil
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

import docstring_parser  # jsonargparse[signatures] reads the same docstrings with it
import lightning as L

import lit_marl.algorithms
import lit_marl.callbacks
import lit_marl.data
import lit_marl.envs
import lit_marl.fields
import lit_marl.parallel.strategies
from lit_marl.envs.base import REGISTRY, Env, FunctionEnv
from lit_marl.fields import MOVED

OUT = Path(__file__).resolve().parent.parent / "docs" / "config.md"
COMMAND = ".venv/bin/python scripts/make_config_reference.py"
# arguments the CLI sets itself (LitMarlCLI.add_arguments_to_parser in lit_marl/cli.py)
LINKED = {(L.LightningModule, "num_agents"): "linked from `data.num_agents`"}
FIELD_TYPES = {k: v for k, v in vars(lit_marl.fields).items() if typing.get_origin(v) is typing.Annotated}
EMPTY = inspect.Parameter.empty
gaps: dict[str, None] = {}  # what lit_marl leaves undescribed, in order


def class_path(cls: type) -> str:
    """The shortest import path of ``cls``: ``lit_marl.algorithms.MAGRPO``, not ``...magrpo.MAGRPO``."""
    parts = cls.__module__.split(".")
    for n in range(1, len(parts)):
        if getattr(sys.modules.get(".".join(parts[:n])), cls.__name__, None) is cls:
            return ".".join(parts[:n] + [cls.__name__])
    return f"{cls.__module__}.{cls.__qualname__}"


def google_args(doc: str | None) -> dict[str, str]:
    """The entries of a docstring's ``Args:`` block, each joined into one line."""
    try:
        params = docstring_parser.parse(doc or "").params
    except docstring_parser.ParseError:
        return {}
    return {p.arg_name.lstrip("*"): " ".join((p.description or "").split()) for p in params}


@functools.cache
def descriptions(klass: type) -> dict[str, str]:
    """What ``klass`` itself says of its arguments: the docstrings under its fields (a dataclass), the
    ``Args:`` of its class docstring, then of its ``__init__``."""
    docs = {}
    if dataclasses.is_dataclass(klass):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = " ".join(inspect.cleandoc(str(b.value.value)).split())
    init = vars(klass).get("__init__")
    return docs | google_args(vars(klass).get("__doc__")) | google_args(getattr(init, "__doc__", None))


def super_call(init) -> tuple[bool, set[str]]:
    """Whether ``init`` passes ``**kwargs`` on to ``super().__init__``, and the keywords it gives there."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError):  # a dataclass's generated __init__
        return False, set()
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and f.attr == "__init__" and isinstance(f.value, ast.Call):
            if getattr(f.value.func, "id", None) == "super":
                return any(k.arg is None for k in node.keywords), {k.arg for k in node.keywords if k.arg}
    return False, set()


@functools.cache
def arguments(cls: type) -> list[tuple[str, object, object, str]]:
    """(name, annotation, default, description) of each argument, walking the MRO as described above."""
    rows, seen, fixed = [], set(), set()
    for klass in [k for k in cls.__mro__ if "__init__" in vars(k) and k is not object]:
        init = vars(klass)["__init__"]
        try:
            hints = typing.get_type_hints(klass if dataclasses.is_dataclass(klass) else init, include_extras=True)
        except Exception:  # annotations naming what only a type checker imports (third-party bases)
            hints = {}
        params = list(inspect.signature(init).parameters.values())[1:]
        forwards, keywords = super_call(init)
        for p in params:
            if p.name in seen | fixed or p.kind is p.VAR_POSITIONAL or (p.kind is p.VAR_KEYWORD and forwards):
                continue
            if p.kind is p.VAR_KEYWORD:
                rows.append(
                    ("**" + p.name, EMPTY, None, f"Further keyword arguments, which `{class_path(klass)}` passes on.")
                )
                continue
            description = next((d[p.name] for k in cls.__mro__ if p.name in (d := descriptions(k))), "")
            if not description and klass.__module__.startswith("lit_marl"):
                gaps[f"{class_path(klass)}: argument {p.name}"] = None
            rows.append((p.name, hints.get(p.name, p.annotation), p.default, description))
        seen |= {p.name for p in params}
        fixed |= keywords - seen
        if not (forwards and any(p.kind is p.VAR_KEYWORD for p in params)):
            break
    return rows


def render_type(t, refs: list[type]) -> str:
    """A readable annotation (``PositiveInt | None``, ``Literal["a", "b"]``); lit_marl classes go to ``refs``."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if name := next((k for k, v in FIELD_TYPES.items() if v == t), None):
        return name
    if t is EMPTY or t is Ellipsis or t is type(None):
        return {EMPTY: "", Ellipsis: "...", type(None): "None"}[t]
    if origin is typing.Literal:
        return f"Literal[{', '.join(json.dumps(a) for a in args)}]"
    if origin is typing.Annotated:
        return render_type(args[0], refs)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(render_type(a, refs) for a in args)
    if isinstance(t, list):  # Callable's arguments
        return f"[{', '.join(render_type(a, refs) for a in t)}]"
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(render_type(a, refs) for a in args)}]" if args else base
    if isinstance(t, type):
        if t.__module__.startswith("lit_marl"):
            refs.append(t)
            return t.__name__
        return t.__name__ if t.__module__ == "builtins" else class_path(t)
    return str(t).replace("typing.", "")


def render_default(value) -> str:
    if value is EMPTY:
        return "required"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)  # as a config gives it
    try:
        return code(json.dumps(value))
    except TypeError:
        return code(getattr(value, "__qualname__", None) or re.sub(r" at 0x[0-9a-f]+", "", repr(value)))


def code(text: str) -> str:
    """``text`` as a code span in a table cell: fenced past its longest run of backticks, ``|`` escaped."""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text.replace('|', chr(92) + '|')}{pad}{fence}" if text else ""


def prose(text: str) -> str:
    """A docstring's text in Markdown: ``code`` as `code`, ``|`` escaped for a table."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|")


def summary(cls: type) -> str:
    """The class docstring's first paragraph (else its module's, where that names the class)."""
    doc = vars(cls).get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "("):
        doc = ""  # the signature dataclasses put there when there is no docstring
    if not doc and re.search(rf"\b{cls.__name__}\b", sys.modules[cls.__module__].__doc__ or ""):
        doc = sys.modules[cls.__module__].__doc__
    if not doc:
        gaps[f"{class_path(cls)}: no docstring"] = None
    return prose(" ".join(inspect.cleandoc(doc).split("\n\n")[0].split()))


def section(cls: type, label: str, anchors: dict[type, str]) -> list[str]:
    lines = [f"### {cls.__name__}", "", label, ""] + ([text, ""] if (text := summary(cls)) else [])
    lines += ["| argument | type | default | description |", "| --- | --- | --- | --- |"]
    for name, annotation, default, description in arguments(cls):
        refs: list[type] = []
        kind = code(render_type(annotation, refs))
        links = [f"[{r.__name__}](#{anchors[r]})" for r in dict.fromkeys(refs) if r in anchors]
        kind += f" ({', '.join(links)})" if links else ""
        linked = next((v for (base, n), v in LINKED.items() if n == name and issubclass(cls, base)), None)
        shown = linked or ("" if default is None and name.startswith("**") else render_default(default))
        lines.append(f"| `{name}` | {kind} | {shown} | {prose(description)} |")
    return lines + [""]


def settings_classes(classes: list[type]) -> list[type]:
    """The lit_marl dataclasses in the argument types of ``classes``, and in their own fields'."""
    found, queue = [], list(classes)
    while queue:
        refs: list[type] = []
        for _, annotation, _, _ in arguments(queue.pop(0)):
            render_type(annotation, refs)
        new = [r for r in dict.fromkeys(refs) if dataclasses.is_dataclass(r) and r not in found]
        found, queue = found + new, queue + new
    return found


def ours(classes, keep=lambda cls: True) -> list[type]:
    """The classes lit_marl defines among ``classes`` (not a test's) that pass ``keep``, in order, once each."""
    classes = dict.fromkeys(c for c in classes if isinstance(c, type))
    return [c for c in classes if c.__module__.startswith("lit_marl.") and keep(c)]


def generate() -> str:
    for module in pkgutil.walk_packages(lit_marl.envs.__path__, "lit_marl.envs."):
        importlib.import_module(module.name)  # every Env subclass defined
    subclasses = lambda c: [d for s in c.__subclasses__() for d in (s, *subclasses(s))]  # noqa: E731
    named = lambda classes: [(f"`class_path: {class_path(c)}`", c) for c in classes]  # noqa: E731
    exported = lambda package: [getattr(package, name) for name in package.__all__]  # noqa: E731
    is_data_module = lambda c: issubclass(c, L.LightningDataModule) and "__init__" in vars(c)  # noqa: E731
    # FunctionEnv is what data.agent_prompts + data.reward_fn build; TaskDataModule, a base, has no arguments
    as_object = lambda c: c is not FunctionEnv and c not in REGISTRY.values() and "__init__" in vars(c)  # noqa: E731
    envs = sorted(ours(subclasses(Env), as_object), key=class_path)
    groups = [
        ("Algorithms (`model`)", named(exported(lit_marl.algorithms))),
        ("Data modules (`data`)", named(ours(vars(lit_marl.data).values(), is_data_module))),
        ("Environments (`data.env` as an object)", named(envs)),
        (
            "Registered environments (`data.env` as a name, with `data.env_kwargs`)",
            [(f"`env: {n}` (`{class_path(c)}`)", c) for n, c in sorted(REGISTRY.items()) if ours([c])],
        ),
        ("Callbacks (`trainer.callbacks`)", named(exported(lit_marl.callbacks))),
        ("Strategies (`trainer.strategy`)", named(ours(vars(lit_marl.parallel.strategies).values()))),
    ]
    settings = settings_classes([c for _, group in groups for _, c in group])
    groups.append(("Settings", [(f"`{class_path(c)}`: a mapping of these fields", c) for c in settings]))
    anchors = {c: c.__name__.lower() for _, group in groups for _, c in group}  # GitHub's heading slugs
    out = [
        "# Configuration reference\n",
        "> Generated by `scripts/make_config_reference.py` from the typed `__init__` arguments: do not edit by"
        f" hand. Regenerate with `{COMMAND}`; `tests/configs/test_docs.py` fails when this file is out of date.\n",
        "A config names a class by `class_path` and sets its arguments under `init_args`; a settings class is"
        " given as a mapping of its fields (`lora: {r: 16}`). Types such as `PositiveInt` or `OpenUnitInterval`"
        " carry bounds (`lit_marl/fields.py`) that are checked when the class is built.\n",
        "`trainer` takes Lightning's `Trainer` arguments. One differs in `lit-marl`: a CPU run that leaves"
        " `trainer.precision` unset gets `bf16-mixed` where the CPU has bf16 units and `32-true` where bf16 would be"
        " emulated ([quickstart.md](quickstart.md#on-the-cpu-you-have)).\n",
    ]
    for title, group in groups:
        out.append(f"## {title}\n")
        for label, cls in group:
            out += section(cls, label, anchors)
    out += moved_settings()
    return "\n".join(out).rstrip() + "\n"


def moved_settings() -> list[str]:
    """The migration table: each setting that moved into a group, its old key and its new one
    (``lit_marl.fields.MOVED``; a config or command line with an old key stops naming the new one)."""
    rows = [f"| `{old}` | `{new}` |" for old, new in MOVED.items()]
    return [
        "## Moved settings\n",
        "Settings that moved into a group keep their names inside it. A config or a command line that gives"
        " one under its old key stops before anything loads, naming the new key; a checkpoint saved before"
        " the move still loads (its settings are put into their groups). In YAML, `data: {init_args:"
        " {on_reward_error: skip}}` becomes `data: {init_args: {reward_calls: {on_reward_error: skip}}}`; on"
        " the command line, `--data.on_reward_error skip` becomes `--data.reward_calls.on_reward_error skip`."
        " `scripts/migrate_config.py FILE...` rewrites YAML files in place (comments kept).\n",
        "| old key | new key |\n|---|---|\n" + "\n".join(rows) + "\n",
    ]


def out_of_date(text: str) -> str:
    """How docs/config.md differs from ``text`` and the command that regenerates it; "" when equal."""
    current = OUT.read_text() if OUT.exists() else ""
    if current == text:
        return ""
    diff = list(
        difflib.unified_diff(current.splitlines(), text.splitlines(), "docs/config.md", "generated", lineterm="")
    )
    more = f"\n... and {len(diff) - 40} more diff lines" if len(diff) > 40 else ""
    return f"docs/config.md is out of date: run `{COMMAND}`\n" + "\n".join(diff[:40]) + more


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/config.md differs from the output")
    check, text = parser.parse_args().check, generate()
    if check:
        print(problem := out_of_date(text), file=sys.stderr, end="\n" if problem else "")
        return 1 if problem else 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(OUT.parent.parent)}")
    print("".join(f"undescribed: {gap}\n" for gap in gaps), end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
