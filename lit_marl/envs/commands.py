"""A text game's actions as tools (``tool_mode: tools``): TextWorld, ALFWorld and Corridor offer
each verb as a typed function (its schema rendered by the agent's chat template, as every tool's),
and a call writes the very command a text-mode reply would be (``Command.forms``), which the game
then reads as it reads text: the same engine, the same sanitizing, the same scores.

One action a turn, as in text mode: a reply's first well-formed call plays; a further call is
answered as not played, a malformed call, an unknown tool or a wrong argument as an error the agent
reads - none of them plays, none crashes. The call's result is the game's observation after the
command. Counted per episode (``env/`` metrics): ``calls``, ``malformed``, ``tool_errors`` (a reply
that calls nothing is one too). The expert's commands (walkthroughs, plans) are read back into calls
(a form's inverse) so that a demonstration shows the same tool calls an RL episode makes.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from lit_marl.tools.calls import ToolResult, ToolResults, failed
from lit_marl.tools.formats import ToolCall, format_calls, read_text
from lit_marl.tools.spec import Tool, as_tool, call_problem

_SEPARATOR = re.compile(r"[.,;]|\bthen\b", re.I)
"""What separates commands in a game's parser (Inform's ``open box. take key``)."""


class CommandError(ValueError):
    """A call that writes no command (the agent is told why)."""


def _fields(form: str) -> tuple[str, ...]:
    return tuple(name for _, name, _, _ in string.Formatter().parse(form) if name)


@dataclass(frozen=True)
class Command:
    """One action of a game as a tool: the tool (name, schema) and the command forms a call writes,
    e.g. ``("take {item} from {source}", "take {item}")``: the first form whose fields are exactly the
    call's given (non-null) arguments."""

    tool: Tool
    forms: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.tool.name

    @cached_property
    def _patterns(self) -> list[re.Pattern]:
        patterns = []
        for form in self.forms:
            parts = string.Formatter().parse(form)
            regex = "".join(re.escape(text) + (f"(?P<{name}>.+?)" if name else "") for text, name, _, _ in parts)
            patterns.append(re.compile(regex, re.I))
        return patterns

    def _allowed(self, key: str) -> list | None:
        return self.tool.schema["function"]["parameters"].get("properties", {}).get(key, {}).get("enum")

    def write(self, arguments: dict) -> str:
        """The command ``arguments`` (a call's) write; ``CommandError`` says what is wrong with them."""
        wrong = self.tool.check_arguments(arguments)
        if wrong:
            raise CommandError(f"{self.name}: {wrong}")
        given = {key: value for key, value in arguments.items() if value is not None}
        for key, value in given.items():
            if not isinstance(value, str) or not value.strip():
                raise CommandError(f"{self.name}: {key} must be a non-empty text, got {value!r}")
            if _SEPARATOR.search(value):  # the game's parser would play a second command: one action a turn
                raise CommandError(f"{self.name}: {key} must name one thing, without . , ; or 'then', got {value!r}")
            allowed = self._allowed(key)
            if allowed and value not in allowed:
                raise CommandError(f"{self.name}: {key} must be one of {', '.join(allowed)}, got {value!r}")
        for form in self.forms:
            if set(_fields(form)) == set(given):
                return form.format(**{key: " ".join(value.split()) for key, value in given.items()})
        needed = " or ".join(", ".join(_fields(f)) or "no arguments" for f in self.forms)
        raise CommandError(f"{self.name}: give {needed}")

    def read(self, command: str) -> ToolCall | None:
        """The call that writes ``command`` (None: this action does not)."""
        for pattern in self._patterns:
            found = pattern.fullmatch(" ".join(command.split()))
            if found and all(self._allowed(k) is None or v in self._allowed(k) for k, v in found.groupdict().items()):
                return ToolCall(self.name, found.groupdict())
        return None


def commands(*actions: tuple[Callable, str | tuple[str, ...]]) -> tuple[Command, ...]:
    """A game's actions: (a typed function describing one, its command form or forms)."""
    return tuple(
        Command(as_tool(fn, f"action {fn.__name__}"), (forms,) if isinstance(forms, str) else tuple(forms))
        for fn, forms in actions
    )


def call_of(actions: Sequence[Command], command: str) -> ToolCall:
    """The call that writes ``command`` (an expert's), or a ``ValueError`` when no action does."""
    for action in actions:
        call = action.read(command)
        if call is not None:
            return call
    raise ValueError(f"the command {command!r} is none of the tools' ({', '.join(a.name for a in actions)})")


def expert_replies(game, turns: list[list[str]]) -> list[list[str]]:
    """An expert's turns (one command each) as the tool calls that write them, in ``game``'s format."""
    return [[format_calls([call_of(game.commands, turn[0])], game.tool_parser)] for turn in turns]


def play_calls(game, reply, counts: dict | None) -> tuple[ToolResults, object, dict]:
    """One turn of ``game`` in tools mode: ``reply``'s first call played as its command (``game.act``),
    every other call and every error answered. Returns the turn's observation (the results), the
    played command's ``StepResult`` (None: nothing played) and ``counts`` (the episode's so far) updated."""
    reply = read_text(reply, game.tool_parser)
    results = [failed(error) for error in reply.errors]
    played, errors = None, 0
    if not reply.calls and not reply.errors:  # a reply that acts not at all: a tool error, as in SWE's tools mode
        results.append(failed(f"no tool call: act by calling one of {', '.join(a.name for a in game.commands)}"))
        errors += 1
    by_name = {action.name: action for action in game.commands}
    tools = {action.name: action.tool for action in game.commands}
    for call in reply.calls:
        if played is not None:
            results.append(ToolResult(call, "error: not played: the game takes one action a turn", True))
            errors += 1
            continue
        try:
            problem = call_problem(call, tools)
            if problem:
                raise CommandError(problem)
            command = by_name[call.name].write(call.arguments)  # and the game's own rules for its arguments
        except CommandError as err:
            results.append(ToolResult(call, f"error: {err}", True))
            errors += 1
            continue
        played = game.act([command])
        results.append(ToolResult(call, played.observations[0]))
    counts = counts or {"calls": 0.0, "malformed": 0.0, "tool_errors": 0.0}
    counts = {
        "calls": counts["calls"] + len(reply.calls),
        "malformed": counts["malformed"] + len(reply.errors),
        "tool_errors": counts["tool_errors"] + errors,
    }
    return ToolResults(tuple(results)), played, counts
