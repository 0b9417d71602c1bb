"""A reply's tool calls run in order, each bounded in time, at most a set number per turn. A tool
function runs in the trainer's process with arguments the model wrote: it must treat them as
untrusted (code the model writes runs in the sandbox: ``lit_marl.sandbox``, the SWE tools). Every
failure (no such tool, wrong arguments, an exception, a timeout, a call over the cap) is a result
the agent reads, never a crash."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from lit_marl.timeouts import TimedOut, timed
from lit_marl.tools.formats import ToolCall
from lit_marl.tools.spec import Tool, call_problem


@dataclass(frozen=True)
class ToolResults:
    """An observation of tool results: each agent reads them as its template's tool messages."""

    results: tuple


@dataclass(frozen=True)
class ToolResult:
    """What one call gave back: its text (the agent reads it) and whether it failed."""

    call: ToolCall
    text: str
    error: bool = False

    def record(self) -> dict:
        """The call as a reward reads it: ``{"name", "arguments", "result", "error"}``."""
        return {**vars(self.call), "result": self.text, "error": self.error}


class Answer(str):
    """An agent's answer after its turn's tool rounds (a tree with ``data.tools``): the text, which a
    reward and a transition read as any answer, and ``calls``, every call of the turn in order
    (``{"name", "arguments", "result", "error"}``), for a reward that scores how it was reached."""

    calls: tuple = ()

    def __new__(cls, text: str, calls=()):
        answer = super().__new__(cls, text)
        answer.calls = tuple(calls)
        return answer


def failed(text: str) -> ToolResult:
    """A result that is no call's: a malformed call, or a reply that called nothing."""
    return ToolResult(ToolCall("error", {}), f"error: {text}", True)


def as_text(value) -> str:
    """A tool's return value as the text the agent reads (JSON for data, ``str`` otherwise)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def run_call(call: ToolCall, tools: dict[str, Tool], timeout_s: float | None) -> ToolResult:
    problem = call_problem(call, tools)
    if problem:
        return ToolResult(call, f"error: {problem}", True)
    try:
        value = timed(lambda: tools[call.name].fn(**call.arguments), timeout_s, f"tool {call.name!r}")
    except TimedOut:
        return ToolResult(call, f"error: {call.name} did not return within {timeout_s:g} s", True)
    except (Exception, SystemExit) as err:  # the tool's own failure: the agent reads it
        return ToolResult(call, f"error: {call.name}: {type(err).__name__}: {err}", True)
    return ToolResult(call, as_text(value))


def run_calls(
    calls: Sequence[ToolCall], tools: Sequence[Tool], timeout_s: float | None = 10.0, max_calls: int = 4
) -> list[ToolResult]:
    """Each of ``calls`` in order (``max_calls`` at most; the rest answered as not run), each within
    ``timeout_s`` seconds."""
    by_name = {tool.name: tool for tool in tools}
    results = [run_call(call, by_name, timeout_s) for call in calls[:max_calls]]
    for call in calls[max_calls:]:
        results.append(ToolResult(call, f"error: not run: at most {max_calls} tool calls per turn", True))
    return results
