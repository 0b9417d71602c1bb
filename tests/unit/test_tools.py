"""Tools in the model's own format: schemas from typed functions, replies parsed into calls in every
named format (parallel and malformed calls included), the rendering each template gets, and the
calls run in order under their limits."""

from __future__ import annotations

import copy
import json
import time

import pytest
from transformers.utils import get_json_schema

from helpers import QWEN25_TOOLS
from lit_marl import ConfigError
from lit_marl.models import load_model_and_tokenizer
from lit_marl.tools import ToolCall, ToolFormat, load_tools, parse_reply, run_calls, tool_format
from lit_marl.tools.formats import (
    FALLBACK_SYSTEM,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    result_messages,
    system_block,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(key: str) -> str:
    """Look a word up.

    Args:
        key: The word.
    """
    return {"tea": "a drink"}[key]


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def untyped(x):
    return x


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_and_tokenizer("tiny-random")[1]


def test_a_typed_function_is_a_tool_with_transformers_schema():
    (tool,) = load_tools([add])
    assert tool.name == "add" and tool.schema == get_json_schema(add)
    assert tool.schema["function"]["parameters"]["required"] == ["a", "b"]
    assert load_tools([f"{__name__}:lookup"])[0].name == "lookup"
    with pytest.raises(ConfigError, match=r"data.tools\[0\]: tool 'untyped' has no schema .*type hint"):
        load_tools([untyped])
    with pytest.raises(ConfigError, match=r"data.tools: two tools named 'add'"):
        load_tools([add, add])
    with pytest.raises(ConfigError, match=r"data.tools\[0\]='nowhere:f': cannot import module"):
        load_tools(["nowhere:f"])


def test_hermes_reads_parallel_calls_and_reports_a_malformed_one():
    reply = parse_hermes(
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"tea\\"}"}\n</tool_call>\n'
        "<tool_call>\n{name: add}\n</tool_call>\n<tool_call>\n[1, 2]\n</tool_call>"
    )
    assert reply.content == "Let me add."
    assert reply.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "tea"})]
    assert len(reply.errors) == 2 and reply.errors[0].startswith("tool call 3: not JSON")
    assert reply.errors[1] == 'tool call 4: a call is a JSON object with a string "name"'
    unclosed = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}')
    assert unclosed.calls == [ToolCall("add", {"a": 1, "b": 1})] and not unclosed.errors
    assert parse_hermes("just text").calls == [] and parse_hermes("just text").content == "just text"


def test_llama3_json_reads_tagged_and_separated_calls():
    two = parse_llama3_json(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "lookup", "parameters": {"key": "x"}}'
    )
    assert two.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "x"})] and not two.errors
    assert parse_llama3_json("The answer is 3.").content == "The answer is 3."
    broken = parse_llama3_json('{"name": "add", "parameters": {"a": 1}} ; {"name": ')
    assert broken.calls == [ToolCall("add", {"a": 1})] and broken.errors[0].startswith("tool call 2: not JSON")


def test_mistral_reads_both_of_its_forms():
    listed = parse_mistral('Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "lookup", '
                           '"arguments": {"key": "tea"}}]')  # fmt: skip
    assert listed.content == "Sure." and [c.name for c in listed.calls] == ["add", "lookup"] and not listed.errors
    v11 = parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]lookup[ARGS]{"key": "tea"}')
    assert v11.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "tea"})]
    bad = parse_mistral("[TOOL_CALLS]add[ARGS]{oops}")
    assert bad.calls == [] and bad.errors[0].startswith("tool call 1: not JSON")
    assert parse_mistral("no calls").calls == []


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer):
    """The tiny model's ChatML template (like SmolLM2's) ignores tools=: the fallback, named."""
    fmt = tool_format(tokenizer)
    assert fmt == ToolFormat("system", "hermes") and "system message" in fmt.describe()
    (tool,) = load_tools([add])
    block = system_block([tool.schema])
    assert json.dumps(tool.schema) in block and block.startswith(FALLBACK_SYSTEM.split("\n")[0])
    assert result_messages([("add", "3")], fmt) == [{"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]


def test_a_template_with_tools_renders_them_and_names_its_parser(tokenizer):
    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN25_TOOLS
    fmt = tool_format(qwen)
    assert fmt == ToolFormat("template", "hermes")
    (tool,) = load_tools([add])
    rendered = qwen.apply_chat_template(
        [{"role": "user", "content": "1+2?"}], tools=[tool.schema], tokenize=False, add_generation_prompt=True
    )
    assert "<tools>\n" + json.dumps(tool.schema) in rendered
    assert result_messages([("add", "3"), ("lookup", "x")], fmt)[1] == {
        "role": "tool",
        "name": "lookup",
        "content": "x",
    }
    assert tool_format(qwen, "mistral") == ToolFormat("template", "mistral")
    with pytest.raises(ConfigError, match="data.tool_parser=template: this tokenizer has no response template"):
        tool_format(qwen, "template")


def test_a_response_template_parses_the_reply(tokenizer):
    """transformers' own Qwen response template, read by ``parse_response``; a malformed call is an error."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = QWEN25_TOOLS
    qwen.response_template = next(v for k, v in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen2" in k)
    fmt = tool_format(qwen)
    assert fmt == ToolFormat("template", "template")
    reply = parse_reply('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', fmt, qwen)
    assert reply.content == "Adding." and reply.calls == [ToolCall("add", {"a": 1, "b": 2})]
    broken = parse_reply("<tool_call>\n{nope\n</tool_call>", fmt, qwen)
    assert broken.calls == [] and broken.errors and broken.errors[0].startswith("tool call: malformed")


def test_calls_run_in_order_and_every_failure_is_a_result():
    tools = load_tools([add, lookup, slow])
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("lookup", {"key": "coffee"}),  # raises KeyError
        ToolCall("add", {"a": 1}),  # a missing argument
        ToolCall("divide", {}),
        ToolCall("slow", {"seconds": 5.0}),
        ToolCall("add", {"a": 0, "b": 0}),  # over the cap
    ]
    started = time.monotonic()
    results = run_calls(calls, tools, timeout_s=0.3, max_calls=5)
    assert time.monotonic() - started < 3.0
    assert [r.text for r in results][:1] == ["5"] and [r.error for r in results] == [False] + [True] * 5
    assert results[1].text == "error: lookup: KeyError: 'coffee'"
    assert results[2].text.startswith("error: add: missing a required argument: 'b'")
    assert results[3].text == "error: no tool named 'divide' (tools: add, lookup, slow)"
    assert results[4].text == "error: slow did not return within 0.3 s"
    assert results[5].text == "error: not run: at most 5 tool calls per turn"


def test_the_calculator_computes_and_never_runs_python():
    from lit_marl.envs.tool_task import calculator, number_answer

    assert (calculator("37 * 91"), calculator("2 ** 10"), calculator("7 / 2"), calculator("-(3 - 5)")) == (
        "3367",
        "1024",
        "3.5",
        "2",
    )
    for attack in ("__import__('os').system('id')", "().__class__", "[1] * 10", "9 ** 9999", "x"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(attack)
    assert number_answer({"answer": 3367}, "The answer is 3,367.", []) == 1.0
    assert number_answer({"answer": 3367}, "3367? no: 3368", []) == 0.0 and number_answer({"answer": 1}, "", []) == 0.0


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_calls_written_in_a_format_read_back_as_the_same_calls(parser):
    from lit_marl.tools.formats import PARSERS, format_calls

    calls = [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "tea"})]
    reply = PARSERS[parser](format_calls(calls, parser))
    assert reply.calls == calls and not reply.errors
