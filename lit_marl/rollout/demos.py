"""Demonstrations: expert chats rendered for supervised fine-tuning exactly as RL renders episodes.

A demonstration is one JSONL row (loadable with ``datasets``)::

    {"task_id": "corridor/demo/3", "messages": [[{"role": "user", "content": "..."},
                                                 {"role": "assistant", "content": "east"}, ...]]}

``messages`` holds one chat per agent (a single agent's chat may be given bare, as a list of
messages); a chat alternates user and assistant messages, starts with the user and ends with the
assistant. System messages are not part of a demonstration: the agent's ``system_prompt`` applies,
as in RL.

Rendering is the token-in/token-out rendering of ``rollout/episode.py``: the first user message
through the chat template with the generation prompt (``Agent.encode_prompt``); each assistant
message as the policy would sample it — its content's tokens followed by the end-of-turn token;
each later user message as the template's new segment only (``Agent.chat_continuation``). The
loss mask is 1 exactly on the assistant tokens (end-of-turn included), on every assistant turn or
only the last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.fields import PositiveInt, check_dataclass
from lit_marl.generation import left_pad
from lit_marl.rollout.batch import Rows
from lit_marl.tasks import load_tasks
from lit_marl.tools.calls import ToolResult, ToolResults
from lit_marl.tools.formats import ToolCall

LossOn = Literal["all", "last"]


@dataclass
class DemoSamples(Rows):
    """One agent's rendered demonstrations, left-padded ``[B, L]``; ``loss_mask`` marks the
    assistant tokens the loss is on."""

    loss_mask: torch.Tensor


def agent_chats(row: dict, num_agents: int, where: str) -> list[list[dict]]:
    """The per-agent chats of a demonstration row, checked; errors name the row and the fix."""
    chats = row.get("messages")
    if not isinstance(chats, list) or not chats:
        raise ConfigError(f"{where}: needs a field 'messages' (one chat per agent, each a list of messages)")
    if isinstance(chats[0], dict):
        chats = [chats]
    if len(chats) != num_agents:
        raise ConfigError(f"{where}: 'messages' holds {len(chats)} chats for a team of {num_agents} agents")
    for i, chat in enumerate(chats):
        roles = [m.get("role") if isinstance(m, dict) else None for m in chat]
        if not chat or not _well_formed(roles) or any(not isinstance(m.get("content"), str) for m in chat):
            raise ConfigError(
                f"{where}: agent {i}'s chat has roles {roles}; it must alternate user and assistant messages with "
                "string contents (tool messages in place of a user message after a reply that called tools), "
                "starting with the user and ending with the assistant (no system message: the agent's "
                "system_prompt applies)"
            )
    return chats


def _well_formed(roles: list) -> bool:
    """User, then assistant replies each followed by a user message or a run of tool messages, ending on a reply."""
    if not roles or roles[0] != "user" or roles[-1] != "assistant":
        return False
    turns = "".join("u" if r == "user" else "a" if r == "assistant" else "t" if r == "tool" else "?" for r in roles)
    return re.fullmatch(r"u(a(u|t+))*a", turns) is not None


def _turns(chat: list[dict]) -> list[tuple[list[dict], str]]:
    """(the observation's messages, the reply) per turn of a well-formed chat."""
    turns, observation = [], []
    for message in chat:
        if message["role"] == "assistant":
            turns.append((observation, message["content"]))
            observation = []
        else:
            observation.append(message)
    return turns


def _observation(messages: list[dict]) -> str | ToolResults:
    """A turn's observation messages as ``chat_continuation`` takes them."""
    if messages[0]["role"] == "user":
        return messages[0]["content"]
    return ToolResults(tuple(ToolResult(ToolCall(m.get("name") or "tool", {}), m["content"]) for m in messages))


def render_chat(agent: Agent, chat: list[dict], loss_on: LossOn = "all") -> tuple[list[int], list[int]]:
    """Token ids of a chat as the agent would have lived it, and the loss mask over them."""
    turns = _turns(chat)
    ids, mask = [], []
    for k, (observation, reply_text) in enumerate(turns):
        if k == 0:
            segment = agent.encode_prompt(observation[0]["content"])
        else:
            segment = agent.chat_continuation(_observation(observation), closed=True)
        ids += segment
        mask += [0] * len(segment)
        reply = agent.tokenizer(reply_text, add_special_tokens=False)["input_ids"] + [agent.eos_token_id]
        ids += reply
        mask += [int(loss_on == "all" or k == len(turns) - 1)] * len(reply)
    return ids, mask


def render_demos(
    agents: list[Agent], rows: list[dict], loss_on: LossOn = "all", max_tokens: int | None = None
) -> list[DemoSamples]:
    """One ``DemoSamples`` per agent: row b of each is demonstration b, rendered by that agent.
    A rendering longer than ``max_tokens`` is an error naming the demonstration (silently cutting
    it would train on a chat the model never sees whole)."""
    out = []
    for i, agent in enumerate(agents):
        rendered = [render_chat(agent, agent_chats(row, len(agents), _where(row))[i], loss_on) for row in rows]
        if max_tokens is not None:
            for row, (ids, _) in zip(rows, rendered):
                if len(ids) > max_tokens:
                    raise ValueError(
                        f"{_where(row)}: agent {i}'s chat renders to {len(ids)} tokens, over data.max_context_tokens="
                        f"{max_tokens}; raise it or shorten the demonstration"
                    )
        device = next(agent.model.parameters()).device
        input_ids, attention_mask = left_pad([ids for ids, _ in rendered], agent.pad_token_id, device)
        loss_mask, _ = left_pad([mask for _, mask in rendered], 0, device)
        out.append(DemoSamples(input_ids, attention_mask, loss_mask))
    return out


@dataclass(frozen=True)
class DemoSettings:
    """The demonstrations of SFT (``data.demos``): the ``SFT`` module's, or the first phase's of
    ``callbacks.PhaseSwitch``."""

    path: str | None = None
    """JSONL rows with one chat per agent (this module's docstring; ``scripts/make_demos.py`` writes them
    from an environment's expert), or the walkthroughs of a named game set played in the run's environment
    (``textworld:<complexity>:<split>:<count>``, ``alfworld:<split>:<count>``: written once, cached; a split
    other than train's and val's). None: no SFT."""
    batch_size: PositiveInt = 8
    """Demonstrations per SFT step."""
    loss_on: Literal["all", "last"] = "all"
    """``all``: the loss on every assistant turn of a demonstration; ``last``: on its last assistant turn
    only (the earlier ones are context)."""

    def __post_init__(self):
        check_dataclass("data.demos", self)


def _where(row: dict) -> str:
    return f"demonstration {row.get('task_id', '(no task_id)')!r}"


def load_demos(path: str, num_agents: int, field: str = "data.demos.path") -> list[dict]:
    """The demonstration rows of a JSONL/JSON/Parquet file, each checked for ``num_agents`` chats."""
    rows = load_tasks(path, field, {"messages"}, needed_by="a demonstration")
    for row in rows:
        agent_chats(row, num_agents, f"{field}={path!r}, {_where(row)}")
    return rows
