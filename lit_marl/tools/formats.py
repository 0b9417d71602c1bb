"""How tools reach the model and how its calls come back, in the model's own format.

Rendering: a chat template that renders ``tools=`` (Qwen's, Llama 3.1's, Mistral's, ...) gets them
through ``apply_chat_template(tools=...)``; one that ignores them (SmolLM2's: the prompt comes out
unchanged) gets them in a system message of one documented format, Hermes's (``FALLBACK_SYSTEM``),
and the results back as ``<tool_response>`` blocks in a user message. Parsing: the tokenizer's own
response template (transformers' ``parse_response``) where it has one, else a named parser:
``hermes`` (``<tool_call>{json}</tool_call>``: Qwen 2.5/3, Hermes), ``llama3_json`` (a JSON object
``{"name", "parameters"}``, after ``<|python_tag|>`` or alone: Llama 3.1/3.2), ``mistral``
(``[TOOL_CALLS]`` then a JSON list, or ``name[ARGS]{json}``). A malformed call is never an
exception: it is an error the agent is shown (``ParsedReply.errors``) and a metric counts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lit_marl import ConfigError

ParserName = Literal["auto", "template", "hermes", "llama3_json", "mistral"]


@dataclass(frozen=True)
class ToolCall:
    """One call the agent made: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclass
class ParsedReply:
    """A reply as text (``content``: what is not a call), its well-formed ``calls`` in order, and an
    error per malformed one (what the agent is told)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _call_from(obj, where: str, arguments_key: str = "arguments") -> ToolCall | str:
    """A ``ToolCall`` from a decoded JSON object, or the error saying what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'{where}: a call is a JSON object with a string "name"'
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"{where}: the arguments of {obj['name']!r} are not a JSON object"
    if not isinstance(arguments, dict):
        return f"{where}: the arguments of {obj['name']!r} are not a JSON object"
    return ToolCall(obj["name"], arguments)


def _collect(reply: ParsedReply, found: ToolCall | str) -> None:
    (reply.calls if isinstance(found, ToolCall) else reply.errors).append(found)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str) -> ParsedReply:
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, any number; an
    unclosed last block is read to the end of the reply."""
    reply = ParsedReply(_HERMES.sub("", text).strip())
    for i, match in enumerate(_HERMES.finditer(text)):
        where = f"tool call {i + 1}"
        try:
            _collect(reply, _call_from(json.loads(match.group(1).strip()), where))
        except json.JSONDecodeError as err:
            reply.errors.append(f"{where}: not JSON ({err.msg} at character {err.pos})")
    return reply


def _json_objects(text: str) -> tuple[list, str | None]:
    """The JSON values of ``text`` one after another (separated by ``;``, commas or whitespace),
    and why the next one does not decode (None: all did)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position == len(text):
            return values, None
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            return values, f"not JSON ({err.msg} at character {err.pos})"
        values.append(value)


def parse_llama3_json(text: str) -> ParsedReply:
    """Llama 3.1's JSON tool calls: the reply (after an optional ``<|python_tag|>``) is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; a reply that does not start
    with ``{`` is text."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedReply(text.strip()) if not tagged else ParsedReply("", errors=["tool call 1: not a JSON object"])
    reply = ParsedReply("")
    values, error = _json_objects(body)
    for i, value in enumerate(values):
        _collect(reply, _call_from(value, f"tool call {i + 1}", "parameters"))
    if error:
        reply.errors.append(f"tool call {len(values) + 1}: {error}")
    return reply


_MISTRAL_ARGS = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\](.*)", re.S)


def parse_mistral(text: str) -> ParsedReply:
    """Mistral's ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` after it (v3), or, per
    ``[TOOL_CALLS]``, ``name[ARGS]{json}`` (v11+); the text before the first is the content."""
    content, _, rest = text.partition("[TOOL_CALLS]")
    reply = ParsedReply(content.strip())
    if not _:
        return reply
    if rest.lstrip().startswith("["):
        values, error = _json_objects(rest)
        calls = [c for v in values for c in (v if isinstance(v, list) else [v])]
        for i, value in enumerate(calls):
            _collect(reply, _call_from(value, f"tool call {i + 1}"))
        if error:
            reply.errors.append(f"tool call {len(calls) + 1}: {error}")
        return reply
    for i, part in enumerate(rest.split("[TOOL_CALLS]")):
        where, match = f"tool call {i + 1}", _MISTRAL_ARGS.match(part)
        if match is None:
            reply.errors.append(f"{where}: expected name[ARGS]{{json}}")
            continue
        values, error = _json_objects(match.group(2))
        if error or len(values) != 1:
            reply.errors.append(f"{where}: {error or 'expected one JSON object of arguments'}")
            continue
        _collect(reply, _call_from({"name": match.group(1), "arguments": values[0]}, where))
    return reply


PARSERS: dict[str, Callable[[str], ParsedReply]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}
"""The named parsers, for templates without a response template of their own."""

FALLBACK_SYSTEM = """You can call tools. Each tool is described by a JSON schema:
<tools>
{tools}
</tools>
To call a tool, write one block per call:
<tool_call>
{{"name": "<tool name>", "arguments": {{<the arguments as a JSON object>}}}}
</tool_call>
The result of each call comes back in a <tool_response> block."""
"""What a chat template without tools support gets in its system message (Hermes's format, which
``parse_hermes`` reads)."""


@dataclass(frozen=True)
class ToolFormat:
    """How one agent sees tools and is read: ``render`` ``template`` (its chat template's
    ``tools=``) or ``system`` (``FALLBACK_SYSTEM``), and its ``parser`` (``template``: the
    tokenizer's response template; else a name of ``PARSERS``)."""

    render: Literal["template", "system"]
    parser: str

    def describe(self) -> str:
        how = "the chat template's tools=" if self.render == "template" else "a system message (Hermes's format)"
        read = "the tokenizer's response template" if self.parser == "template" else f"the {self.parser} parser"
        return f"tools rendered by {how}, replies read by {read}"


def renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template renders a ``tools=`` list (a probe tool changes the prompt)."""
    probe = {"type": "function", "function": {"name": "probe_tool_xq", "description": "p", "parameters": {}}}
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"tokenize": False, "add_generation_prompt": True}
    try:
        with_tools = tokenizer.apply_chat_template(messages, tools=[probe], **kwargs)
    except Exception:  # a template that refuses tools does not render them
        return False
    return with_tools != tokenizer.apply_chat_template(messages, **kwargs)


_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"),
                   ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))  # fmt: skip


def tool_format(tokenizer, parser: ParserName = "auto", field: str = "data.tool_parser") -> ToolFormat:
    """How ``tokenizer``'s model gets its tools and is read. ``auto``: its response template if it has
    one, else the parser its chat template names (its tool-call markers); a template that ignores
    ``tools=`` renders them in the system message and is read by ``hermes``."""
    if not renders_tools(tokenizer):
        return ToolFormat("system", written_as(parser))
    if parser == "template" and getattr(tokenizer, "response_template", None) is None:
        raise ConfigError(f"{field}=template: this tokenizer has no response template; name a parser ({_names()})")
    if parser != "auto":
        return ToolFormat("template", parser)
    if getattr(tokenizer, "response_template", None) is not None:
        return ToolFormat("template", "template")
    source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    for mark, name in _TEMPLATE_MARKS:
        if mark in source:
            return ToolFormat("template", name)
    raise ConfigError(
        f"{field}=auto: the chat template renders tools but shows no call format lit_marl knows; set {field} to "
        f"one of {_names()}"
    )


def _names() -> str:
    return ", ".join(PARSERS)


def parse_reply(text: str, fmt: ToolFormat, tokenizer=None, tools: Sequence[dict] = ()) -> ParsedReply:
    """``text`` (the reply as generated, special tokens kept, its end-of-turn token removed) read as
    ``fmt`` says: text and calls."""
    if fmt.parser != "template":
        return PARSERS[fmt.parser](text)
    try:
        message = tokenizer.parse_response(text, prefix="", tools=list(tools) or None)
    except (ValueError, TypeError, KeyError) as err:
        return ParsedReply(text.strip(), errors=[f"tool call: malformed ({err})"])
    reply = ParsedReply((message.get("content") or "").strip())
    for i, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, dict) else call
        _collect(reply, _call_from(function, f"tool call {i + 1}"))
    return reply


def written_as(parser: str) -> str:
    """The named format a text call is written and read in: ``parser``, Hermes's for ``auto``/``template``."""
    return "hermes" if parser in ("auto", "template") else parser


def read_text(reply, parser: str) -> ParsedReply:
    """A reply as an environment gets it: parsed already by the rollout, or a text (an expert's) read
    in ``written_as(parser)``."""
    return reply if isinstance(reply, ParsedReply) else PARSERS[written_as(parser)](str(reply))


def format_calls(calls: Sequence[ToolCall], parser: str = "hermes") -> str:
    """``calls`` written as a reply in ``parser``'s format (``auto``/``template``: Hermes's), which
    that parser reads back as the same calls: an expert's demonstration."""
    payload, parser = [{"name": c.name, "arguments": c.arguments} for c in calls], written_as(parser)
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps(payload)
    return "\n".join(f"<tool_call>\n{json.dumps(p)}\n</tool_call>" for p in payload)


def system_block(tools: Sequence[dict]) -> str:
    """``FALLBACK_SYSTEM`` for ``tools`` (their schemas, one JSON line each)."""
    return FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def result_messages(results: Sequence[tuple[str, str]], fmt: ToolFormat) -> list[dict]:
    """The messages that bring ``results`` ((tool name, text) per call, in order) back: one ``tool``
    message each where the template renders tools, else one user message of ``<tool_response>`` blocks."""
    if fmt.render == "template":
        return [{"role": "tool", "name": name, "content": text} for name, text in results]
    blocks = "\n".join(f"<tool_response>\n{text}\n</tool_response>" for _, text in results)
    return [{"role": "user", "content": blocks}]
