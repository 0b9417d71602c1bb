"""A tool is a typed Python function: its JSON schema is read from its signature and its
Google-style docstring (transformers' ``get_json_schema``, the schema ``apply_chat_template(tools=)``
renders), so the model sees exactly what the function accepts."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers.utils import get_json_schema

from lit_marl import ConfigError
from lit_marl.tasks import import_object


@dataclass(frozen=True)
class Tool:
    """A tool the agent may call: ``fn`` runs with the call's arguments; ``schema`` is what the
    chat template renders (``{"type": "function", "function": {name, description, parameters}}``)."""

    name: str
    fn: Callable
    schema: dict

    def check_arguments(self, arguments: dict) -> str | None:
        """Why ``fn`` cannot take ``arguments`` (a missing or unknown argument), None when it can."""
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as err:
            return str(err)
        return None


def call_problem(call, tools: dict[str, Tool]) -> str | None:
    """What stops ``call`` (its ``name`` and ``arguments``) from running among ``tools`` (by name): no
    tool of its name, or arguments its function cannot take; None: nothing."""
    tool = tools.get(call.name)
    if tool is None:
        return f"no tool named {call.name!r} (tools: {', '.join(tools) or 'none'})"
    wrong = tool.check_arguments(call.arguments)
    return f"{call.name}: {wrong}" if wrong else None


def as_tool(item: Callable | str | Tool, field: str) -> Tool:
    """``item`` (a function, a ``module:function`` path or a ``Tool``) as a ``Tool``, or a
    ``ConfigError`` naming ``field`` and what the function lacks."""
    if isinstance(item, Tool):
        return item
    fn = import_object(item, field) if isinstance(item, str) else item
    if not callable(fn):
        raise ConfigError(f"{field}: {item!r} is not a function")
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"{field}: tool {name!r} has no schema ({err}): give every argument a type hint and the function a "
            "Google-style docstring with an Args: line per argument"
        ) from err
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(items: Sequence[Callable | str | Tool] | None, field: str = "data.tools") -> list[Tool]:
    """The tools ``items`` name, in order; two tools of one name are refused."""
    tools = [as_tool(item, f"{field}[{i}]") for i, item in enumerate(items or ())]
    names = [tool.name for tool in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"{field}: two tools named {repeated[0]!r}: a call names its tool, so each name must be one")
    return tools
