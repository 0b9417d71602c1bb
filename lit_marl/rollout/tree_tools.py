"""Tools in a joint rollout tree (``data.tools``): within its turn, each agent's reply may call tools;
the calls run, their results come back in the agent's own format (tool messages, or the fallback's
``<tool_response>`` blocks) and the agent replies again, for at most ``max_rounds`` rounds, until a
reply without a call: its answer, the action the joint reward and the transition read (an
``Answer``: a string whose ``calls`` hold the turn's calls and results, for a reward that reads them). Every reply
of the turn is trained (loss mask 1, its end-of-turn token included); the results and the template's
glue between replies are environment tokens (mask 0) inside the same row, so a response's return
and group are the tree's as ever. The result reaches the agent that called it; with ``share: team``
the turn's calls and results of every agent are also shown to the whole team in the next turn's
prompts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import roles_by_model
from lit_marl.fields import PositiveInt, check_dataclass
from lit_marl.generation.base import Generation, left_pad
from lit_marl.tools.calls import Answer, ToolResults, failed, run_calls
from lit_marl.tools.formats import ParserName
from lit_marl.tools.spec import Tool, load_tools


@dataclass(frozen=True)
class TreeTools:
    """``data.tools`` of the tree data module: the tools every agent may call in its turn."""

    functions: tuple[Callable | str, ...] = ()
    """The tools: functions, or ``module:function`` paths (typed, with an ``Args:`` docstring)."""
    parser: ParserName = "auto"
    """How replies are read (docs/tools.md): ``auto``, ``template``, ``hermes``, ``llama3_json``, ``mistral``."""
    max_rounds: PositiveInt = 2
    """Tool rounds an agent may take within one turn; the reply after the last round is its answer."""
    max_calls_per_turn: PositiveInt = 4
    """Calls run per reply, in order; the rest are answered as not run."""
    call_timeout_s: float = 10.0
    """Time limit of one call."""
    max_result_chars: PositiveInt = 2000
    """Characters of one result the agent reads (the rest is cut, marked): each round's prompt holds
    every earlier reply and result."""
    share: Literal["caller", "team"] = "caller"
    """Who reads a result: the agent that called (in its turn), or also the whole team (in the next
    turn's prompts: each agent's calls and results listed after its prompt)."""

    def __post_init__(self):
        check_dataclass("data.tools", self)
        object.__setattr__(self, "functions", tuple(self.functions))
        if not self.tools:
            raise ConfigError("data.tools.functions is empty: name the tools (module:function), or drop data.tools")

    @cached_property
    def tools(self) -> tuple[Tool, ...]:
        """The functions as tools (their schemas read once)."""
        return tuple(load_tools(self.functions, "data.tools.functions"))

    def saved(self) -> dict:
        """The settings as a checkpoint keeps them: each function as its ``module:function`` path."""
        named = [f if isinstance(f, str) else f"{f.__module__}:{f.__qualname__}" for f in self.functions]
        return {**asdict(self), "functions": named}


@dataclass
class _Row:
    """One response's turn so far: its tokens after the prompt, which are trained, their log-probs."""

    prompt: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    last: list[int]  # the latest reply's tokens
    calls: list[dict] = field(default_factory=list)
    malformed: int = 0
    done: bool = False
    tool_s: float = 0.0  # its calls' time


def _rows(g: Generation) -> list[_Row]:
    rows = []
    for k in range(g.completion_ids.shape[0]):
        keep = g.completion_mask[k].bool()
        reply = g.completion_ids[k][keep].tolist()
        logprobs = [0.0] * len(reply) if g.logprobs is None else g.logprobs[k][keep].tolist()
        rows.append(_Row(g.prompt_ids[k][g.prompt_mask[k].bool()].tolist(), reply, [1] * len(reply), logprobs, reply))
    return rows


def _cut(result, limit: int):
    if len(result.text) <= limit:
        return result
    return replace(result, text=f"{result.text[:limit]}\n[... {len(result.text) - limit} more characters cut]")


def _run_round(agent, rows: list[_Row], settings: TreeTools) -> list[int]:
    """Each live row's latest reply read; its calls run and their results appended (mask 0). Returns
    the rows that called a tool and go on; a reply without a call (or cut by the token budget) is the answer."""
    going = []
    for r, row in enumerate(rows):
        if row.done:
            continue
        reply = agent.read_reply(row.last)
        if not (reply.calls or reply.errors) or row.last[-1:] != [agent.eos_token_id]:
            row.done = True
            continue
        start = time.perf_counter()
        ran = run_calls(reply.calls, settings.tools, settings.call_timeout_s, settings.max_calls_per_turn)
        row.tool_s += time.perf_counter() - start
        results = [failed(e) for e in reply.errors] + [_cut(x, settings.max_result_chars) for x in ran]
        row.calls += [result.record() for result in results[len(reply.errors) :]]
        row.malformed += len(reply.errors)
        glue = agent.chat_continuation(ToolResults(tuple(results)))
        row.ids, row.mask, row.logprobs = row.ids + glue, row.mask + [0] * len(glue), row.logprobs + [0.0] * len(glue)
        going.append(r)
    return going


def tool_rounds(agents, gens: list[Generation], settings: TreeTools, sampling, engine) -> tuple[list, list, list]:
    """The turn's tool rounds for every agent's rows: ONE batched generation per model per round over
    every row that called a tool (roles of one model together, as the first generation). Returns each
    agent's generation (the whole turn as its completion), its answers (the last reply's text without
    calls, with the turn's ``calls``: ``Answer``) and the rows (``_Row``: calls, malformed, last reply)."""
    rows = [_rows(g) for g in gens]
    complete = [g.logprobs is not None for g in gens]  # every reply of the agent came with log-probs
    groups = roles_by_model(agents)
    for _ in range(settings.max_rounds):
        going = [_run_round(agent, agent_rows, settings) for agent, agent_rows in zip(agents, rows)]
        calls, placed = [], []
        for roles in groups:
            live = [(i, r) for i in roles for r in going[i]]
            if live:
                calls.append((agents[roles[0]], [rows[i][r].prompt + rows[i][r].ids for i, r in live], 1))
                placed.append(live)
        if not calls:
            break
        for live, out in zip(placed, engine.generate_team(calls, sampling)):
            for k, (i, r) in enumerate(live):
                row, keep = rows[i][r], out.completion_mask[k].bool()
                reply = out.completion_ids[k][keep].tolist()
                complete[i] = complete[i] and out.logprobs is not None
                logprobs = [0.0] * len(reply) if out.logprobs is None else out.logprobs[k][keep].tolist()
                row.ids, row.mask, row.logprobs = row.ids + reply, row.mask + [1] * len(reply), row.logprobs + logprobs
                row.last = reply
    answers = [
        [Answer(agent.read_reply(row.last).content, row.calls) for row in agent_rows]
        for agent, agent_rows in zip(agents, rows)
    ]
    turn = [_generation(a, g, agent_rows, ok) for a, g, agent_rows, ok in zip(agents, gens, rows, complete)]
    return turn, answers, rows


def _generation(agent, first: Generation, rows: list[_Row], logprobs_given: bool) -> Generation:
    """The rows' whole turns as one generation: the first prompts, completions right-padded."""
    width = max(len(row.ids) for row in rows)
    ids = torch.full((len(rows), width), agent.pad_token_id, dtype=torch.long)
    mask, attention, logprobs = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros(len(rows), width)
    for k, row in enumerate(rows):
        n = len(row.ids)
        ids[k, :n], mask[k, :n], attention[k, :n] = torch.tensor(row.ids), torch.tensor(row.mask), 1
        logprobs[k, :n] = torch.tensor(row.logprobs)
    prompt_ids, prompt_mask = left_pad([row.prompt for row in rows], agent.pad_token_id, torch.device("cpu"))
    device = first.completion_ids.device
    return Generation(
        prompt_ids.to(device),
        prompt_mask.to(device),
        ids.to(device),
        mask.to(device),
        first.num_samples,
        logprobs.to(device, first.logprobs.dtype) if logprobs_given else None,
        attention.to(device),
    )


def turn_counts(agents, rows: list[list[_Row]]) -> dict[str, float]:
    """The turn's tool metrics: calls made, malformed ones, failed ones, and answers cut by the token budget."""
    every = [row for agent_rows in rows for row in agent_rows]
    closed = [row.last[-1:] == [agent.eos_token_id] for agent, agent_rows in zip(agents, rows) for row in agent_rows]
    return {
        "train/tool_calls": float(sum(len(row.calls) for row in every)),
        "train/tool_malformed": float(sum(row.malformed for row in every)),
        "train/tool_errors": float(sum(c["error"] for row in every for c in row.calls)),
        "truncated": float(sum(not c for c in closed)),
        "perf/tool_s": sum(row.tool_s for row in every),
    }


def team_block(calls_by_agent: list[list[dict]]) -> str:
    """What ``share: team`` adds to every agent's next prompt: each agent's calls of the joint action
    and their results ("" when none called)."""
    lines = []
    for i, calls in enumerate(calls_by_agent):
        for call in calls:
            args = json.dumps(call["arguments"], ensure_ascii=False)
            lines.append(f"agent {i}: {call['name']}({args}) -> {call['result']}")
    return "\n\nThe team's tool calls last turn:\n" + "\n".join(lines) if lines else ""
