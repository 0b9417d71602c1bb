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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch

from lit_marl import ConfigError
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


@dataclass
class _Row:
    """One response's turn so far: its tokens after the prompt, which are trained, their log-probs."""

    prompt: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    last: list[int]  # the latest reply's tokens
    calls: list[dict] = field(default_factory=list)
    done: bool = False


def _rows(g: Generation) -> list[_Row]:
    rows = []
    for k in range(g.completion_ids.shape[0]):
        keep = g.completion_mask[k].bool()
        reply = g.completion_ids[k][keep].tolist()
        logprobs = [0.0] * len(reply) if g.logprobs is None else g.logprobs[k][keep].tolist()
        rows.append(_Row(g.prompt_ids[k][g.prompt_mask[k].bool()].tolist(), reply, [1] * len(reply), logprobs, reply))
    return rows


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
        results = [failed(e) for e in reply.errors]
        results += run_calls(reply.calls, settings.tools, settings.call_timeout_s, settings.max_calls_per_turn)
        row.calls += [{**vars(x.call), "result": x.text, "error": x.error} for x in results]
        glue = agent.chat_continuation(ToolResults(tuple(results)))
        row.ids, row.mask, row.logprobs = row.ids + glue, row.mask + [0] * len(glue), row.logprobs + [0.0] * len(glue)
        going.append(r)
    return going


def tool_rounds(agents, gens: list[Generation], settings: TreeTools, sampling, engine) -> tuple[list, list, list]:
    """The turn's tool rounds for every agent's rows: ONE batched generation per round over every row
    that called a tool. Returns each agent's generation (the whole turn as its completion), its
    answers (the last reply's text without calls, with the turn's ``calls``: ``Answer``) and the calls of each row."""
    rows = [_rows(g) for g in gens]
    for _ in range(settings.max_rounds):
        going = [_run_round(agent, agent_rows, settings) for agent, agent_rows in zip(agents, rows)]
        calls = [(agents[i], [rows[i][r].prompt + rows[i][r].ids for r in going[i]], 1) for i in range(len(agents))]
        live = [i for i, c in enumerate(calls) if c[1]]
        if not live:
            break
        outputs = engine.generate_team([calls[i] for i in live], sampling)
        for i, out in zip(live, outputs):
            for k, r in enumerate(going[i]):
                row, keep = rows[i][r], out.completion_mask[k].bool()
                reply = out.completion_ids[k][keep].tolist()
                logprobs = [0.0] * len(reply) if out.logprobs is None else out.logprobs[k][keep].tolist()
                row.ids, row.mask, row.logprobs = row.ids + reply, row.mask + [1] * len(reply), row.logprobs + logprobs
                row.last = reply
    for agent_rows in rows:
        for row in agent_rows:
            row.done = True
    answers = [
        [Answer(agent.read_reply(row.last).content, row.calls) for row in agent_rows]
        for agent, agent_rows in zip(agents, rows)
    ]
    turn = [_generation(agent, g, agent_rows) for agent, g, agent_rows in zip(agents, gens, rows)]
    return turn, answers, [[row.calls for row in agent_rows] for agent_rows in rows]


def _generation(agent, first: Generation, rows: list[_Row]) -> Generation:
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
        None if first.logprobs is None else logprobs.to(device, first.logprobs.dtype),
        attention.to(device),
    )


def team_block(calls_by_agent: list[list[dict]]) -> str:
    """What ``share: team`` adds to every agent's next prompt: each agent's calls of the joint action
    and their results ("" when none called)."""
    lines = []
    for i, calls in enumerate(calls_by_agent):
        for call in calls:
            args = json.dumps(call["arguments"], ensure_ascii=False)
            lines.append(f"agent {i}: {call['name']}({args}) -> {call['result']}")
    return "\n\nThe team's tool calls last turn:\n" + "\n".join(lines) if lines else ""
