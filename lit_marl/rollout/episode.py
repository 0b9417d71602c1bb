"""Multi-turn episodes in stateful environments, token-in / token-out.

Every episode is one token sequence: the first observation rendered with the chat template, then
per turn the sampled reply tokens exactly as generated (end-of-turn token included) and the next
observation as the chat template's new segment only (``Agent.chat_continuation``). What training
sees is therefore exactly what the model conditioned on and produced; the assistant's text is
never re-tokenized. Per turn there is ONE batched generate over all live episodes of the step and
the environments step in parallel (``turns: lockstep``); with ``turns: independent`` (an engine that
generates remotely) each episode plays its own turns in a thread of its own, its next request sent as
soon as its environment has stepped: no episode waits for another's turn, and the server batches the
requests of every live episode as they come.

Budgets: ``max_turns``; ``sampling.max_new_tokens`` per reply; ``max_context_tokens`` for the whole
sequence: when the next observation plus a reply would not fit, the episode ends as
``truncated`` (its reward is what it earned so far, never dropped).
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent, give_tools, roles_by_model
from lit_marl.envs.base import Env
from lit_marl.generation import Engine, left_pad, make_engine
from lit_marl.generation.base import Sampling, prefill_counts, prefill_stats, stream_seed
from lit_marl.metrics import markdown_line
from lit_marl.returns import neutral_fill


@dataclass
class EpisodeBatch:
    """G episodes per task, consecutive rows; ``[B, L]`` tensors are left-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    """1 on the agent's sampled tokens (end-of-turn included), 0 on prompts, observations, padding."""
    end_positions: torch.Tensor
    """``[B, T]``: index in the row of each turn's last sampled token; -1 after the episode's end."""
    scores: torch.Tensor
    """``[B, T]``: the env's cumulative score after each turn (carried after the end)."""
    won: torch.Tensor
    lost: torch.Tensor
    truncated: torch.Tensor
    max_score: torch.Tensor
    num_turns: torch.Tensor
    group_ids: torch.Tensor
    replies: list[list[str]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    rewards: torch.Tensor | None = None
    """``[B, T]`` each turn's reward (the env's: a text environment's reward function, a game's
    outcome by its ``RewardRule``); 0 after an episode's end."""
    rollout_logprobs: torch.Tensor | None = None
    """``[B, L]``: the rollout engine's log-prob of each sampled token (``Generation.logprobs``), 0 on
    other tokens; None when the engine gave none."""
    anchors: torch.Tensor | None = None
    """``[B, T]``: an id of the state each turn acted from (``EpisodeSettings.anchor``), -1 after the
    episode's end; equal ids within a task's group: the same state (GiGPO's anchor states)."""

    @property
    def alive(self) -> torch.Tensor:
        """``[B, T]``: whether the episode played turn t."""
        return self.end_positions >= 0

    @functools.cached_property
    def turn_ids(self) -> torch.Tensor:
        """``[B, L]``: the turn each sampled token belongs to, -1 elsewhere."""
        out = torch.full_like(self.input_ids, -1)
        positions = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)
        for t in range(self.end_positions.shape[1] - 1, -1, -1):
            end = self.end_positions[:, t : t + 1].to(positions.device)
            out = torch.where((positions <= end) & (end >= 0) & self.loss_mask.bool(), t, out)
        return out

    def per_turn(self, token_values: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` -> ``[B, T]``: the sum over each turn's sampled tokens."""
        turns = self.turn_ids.to(token_values.device)
        return torch.stack([(token_values * (turns == t)).sum(dim=1) for t in range(self.alive.shape[1])], dim=1)

    def to_tokens(self, turn_values: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` -> ``[B, L]``: each turn's value on every token it sampled, 0 elsewhere."""
        turns = self.turn_ids.to(turn_values.device)
        out = torch.zeros(turns.shape, dtype=turn_values.dtype, device=turn_values.device)
        for t in range(turn_values.shape[1]):
            out = torch.where(turns == t, turn_values[:, t : t + 1], out)
        return out

    def turn_starts(self) -> torch.Tensor:
        """``[B, T]``: index of each turn's first sampled token (0 where the turn was not played)."""
        return torch.stack([(self.turn_ids == t).float().argmax(dim=1) for t in range(self.alive.shape[1])], dim=1)

    def token_rewards(self, turn_rewards: torch.Tensor) -> torch.Tensor:
        """Each turn's reward ``[B, T]`` on that turn's last sampled token, ``[B, L]``."""
        out = torch.zeros(self.input_ids.shape, dtype=torch.float32)
        rows, turns = torch.nonzero(self.alive, as_tuple=True)
        out[rows, self.end_positions[rows, turns]] = turn_rewards[rows, turns].float()
        return out


@dataclass
class _Live:
    state: object  # the environment's state (``Env.reset``)
    ids: list[list[int]]  # per agent
    mask: list[list[int]]
    ends: list[list[int]]
    replies: list[list[str]]
    keys: list[list[str]]  # per agent, per turn: the anchor key of the state the turn acts from
    # per agent, per turn: (index of the reply's first token, the engine's log-probs of its tokens or None)
    logprobs: list[list[tuple[int, list[float] | None]]]
    scores: list[float] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)  # per turn, per agent: the env's reward
    info: dict = field(default_factory=dict)
    done: bool = False
    truncated: bool = False
    seed: int | None = None  # the episode's sampling stream (``turns: independent``): request seeds per agent and turn


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes are played; the data module builds one from its settings (``EpisodeDataModule``
    documents each field). ``group_size`` episodes per task start from the same state."""

    group_size: int = 1
    max_turns: int = 8
    max_context_tokens: int = 2048
    sampling: Sampling = Sampling()
    anchor: Literal["state", "observation"] = "state"
    """What identifies a turn's state for step-level groups: ``state``, the env's canonical
    ``state_key()`` where it has one (else the observation); ``observation``, the agent's observation text."""
    reasoning: Literal["none", "think"] = "none"
    """What of a reply the env gets as the action (``action_text``); the training row keeps the whole reply."""
    history: Literal["verbatim", "strict"] = "verbatim"
    """A chat template that rewrites earlier turns (``Agent.rewrites_history``): ``verbatim`` keeps every
    reply as generated in the context (a warning says so); ``strict`` refuses it, so the context is
    always the template's own rendering of the dialogue."""
    turns: Literal["lockstep", "independent"] = "lockstep"
    """``lockstep``: turn t of every live episode is one batched generate and one ``env.step``;
    ``independent``: each episode plays its turns on its own (a thread each; an engine that generates
    remotely, its requests seeded per episode, agent and turn from the engine's ``draw_seed``)."""


def action_text(reply: str, reasoning: Literal["none", "think"], opened: bool = False) -> str:
    """The action in a reply: all of it, or with ``think`` (Qwen3-style reasoning) the text after the
    last ``</think>`` up to any new ``<think>``. Reasoning still open at the reply's end (a ``<think>``
    never closed, or with ``opened``, a generation prompt that opened it and no ``</think>``: cut by the
    token budget) acts with the empty string: no command is read out of unfinished reasoning."""
    if reasoning == "none":
        return reply
    if "</think>" in reply:
        return reply.rsplit("</think>", 1)[1].split("<think>", 1)[0].strip()
    return "" if opened or "<think>" in reply else reply


def run_episodes(
    agents: list[Agent],
    tasks: list[dict],
    env: Env,
    settings: EpisodeSettings = EpisodeSettings(),
    engine: Engine | None = None,
) -> list[EpisodeBatch]:
    """``settings.group_size`` episodes per task from the same start; one batch per agent (agent i's
    own token sequences: its observations and its replies), sharing the outcome fields. Agents that
    are one model (a parameter-shared team) generate in one batched call per turn, and ONE
    ``env.step`` plays the turn of every live episode (``turns: independent``: each episode its own
    turns, ``env.step`` over its state alone); ``engine`` generates (default: ``auto``)."""
    start = time.perf_counter()
    engine = engine or make_engine("auto")
    if env.num_agents != len(agents):
        raise ValueError(f"{type(env).__name__} has {env.num_agents} agents, the team {len(agents)}")
    _check_templates(agents, settings)
    give_tools(agents, env.tools, env.tool_parser)
    prefill = prefill_counts(engine)
    states: list = []
    try:
        states += env.reset([task for task in tasks for _ in range(settings.group_size)])
        episodes = _start(agents, states, env, settings)
        clock = dict.fromkeys(("generate_s", "env_s", "generated"), 0.0)
        independent = settings.turns == "independent"
        if independent:
            _play_independently(agents, env, episodes, settings, engine, clock)
        else:
            for turn in range(settings.max_turns):
                live = [e for e in episodes if not e.done]
                if not live:
                    break
                _play_turn(agents, env, live, turn, settings, engine, clock)
    finally:  # also when an episode raised: no workspace or process outlives its rollout
        env.release(states)
    steps = sum(len(e.scores) for e in episodes)
    seconds = time.perf_counter() - start
    stats = {
        "perf/generate_s": clock["generate_s"],
        "perf/env_s": clock["env_s"],
        "perf/rollout_s": seconds,
        "perf/generated_tokens": float(clock["generated"]),
        # independent turns: generate_s and env_s are sums over episodes (they overlap): the rate is per wall second
        "perf/tokens_per_s": clock["generated"] / max(seconds if independent else clock["generate_s"], 1e-9),
        "train/env_steps": float(steps),
        "perf/env_steps_per_s": steps / max(seconds, 1e-9),
        **prefill_stats(engine, prefill),
    }
    for key in sorted({k for e in episodes for k in e.info.get("counts", {})}):  # the env's own counts
        stats[f"env/{key}"] = sum(float(e.info.get("counts", {}).get(key, 0.0)) for e in episodes) / len(episodes)
    return _batches(agents, episodes, len(tasks), settings.group_size, stats)


def _check_templates(agents, settings: EpisodeSettings) -> None:
    for i, agent in enumerate(agents):
        if agent.rewrites_history and settings.history == "strict":
            raise ConfigError(
                f"data.history=strict: agent {i}'s chat template ({agent.source}) rewrites earlier turns (e.g. "
                "Qwen3 drops past think blocks), so no single context is both the template's rendering and what "
                "each turn was generated from; use data.history: verbatim (every reply kept as generated)"
            )
        if agent.rewrites_history:
            warnings.warn(
                f"agent {i}'s chat template ({agent.source}) rewrites earlier turns (e.g. Qwen3 drops past think "
                "blocks): episodes keep every reply verbatim in the context, so each turn is trained on exactly "
                "what it was generated from, but the context is not the template's own rendering of the dialogue",
                stacklevel=3,
            )


def _start(agents, states: list, env: Env, settings: EpisodeSettings) -> list[_Live]:
    """One episode per state; each agent's first observation encoded."""
    episodes = [_Live(state, *([[] for _ in agents] for _ in range(6))) for state in states]
    for e, keys in zip(episodes, _anchor_keys(env, episodes, settings)):
        _add_keys(e, e.state.observations, keys, settings.anchor)
        for i, agent in enumerate(agents):
            e.ids[i] = agent.encode_prompt(e.state.observations[i])
            e.mask[i] = [0] * len(e.ids[i])
            if len(e.ids[i]) + settings.sampling.max_new_tokens > settings.max_context_tokens:
                raise ValueError(
                    f"the first observation takes {len(e.ids[i])} tokens: it leaves no room for a reply of "
                    f"{settings.sampling.max_new_tokens} within max_context_tokens={settings.max_context_tokens}"
                )
    return episodes


def _now(fn):
    return fn()


def _play_independently(agents, env: Env, episodes: list[_Live], settings: EpisodeSettings, engine, clock: dict):
    """``turns: independent``: every episode plays its turns in a thread of its own (``_play_turn`` over it
    alone), so its next request leaves as soon as its environment has stepped; the environment's work runs
    in its pool (``data.env_workers`` at once). Each episode's requests are seeded from its own stream (the
    engine's ``draw_seed``, the episode's index, the agent, the turn): the rollout does not depend on the
    order replies arrive in. The first episode to raise stops the others at their next turn (an interrupt
    of the caller too); its error is raised once every thread has ended."""
    base = engine.draw_seed()
    for index, e in enumerate(episodes):
        e.seed = stream_seed(base, index)
    stop, lock, errors = threading.Event(), threading.Lock(), []
    env_call = (lambda fn: env.pool.submit(fn).result()) if env.pool is not None else _now

    def play(e: _Live) -> None:
        mine = dict.fromkeys(clock, 0.0)
        try:
            for turn in range(settings.max_turns):
                if e.done or stop.is_set():
                    return
                _play_turn(agents, env, [e], turn, settings, engine, mine, env_call)
        except BaseException as error:
            with lock:
                errors.append(error)
            stop.set()
        finally:
            with lock:
                for key, value in mine.items():
                    clock[key] += value

    with ThreadPoolExecutor(len(episodes), thread_name_prefix="lit_marl_episode") as pool:
        try:
            for future in [pool.submit(play, e) for e in episodes]:
                future.result()
        except BaseException:  # the caller interrupted: the episodes stop at their next turn
            stop.set()
            raise
    if errors:
        raise errors[0]


def _play_turn(
    agents, env: Env, live: list[_Live], turn: int, settings: EpisodeSettings, engine, clock: dict, env_call=None
) -> None:
    """ONE batched generation per model over the live episodes (the models together), then ONE
    ``env.step`` over their states; the next observations are appended, or the episode ends. ``env_call``
    runs the environment's work (independent turns: in its pool; else here)."""
    env_call = env_call or _now
    t0 = time.perf_counter()
    texts, closed = _generate_replies(agents, live, turn, settings, engine, clock)
    t1 = time.perf_counter()
    last = turn == settings.max_turns - 1
    steps = env_call(lambda: env.step([e.state for e in live], texts, turn, last=last))
    ended, going = [], []  # ended: cut short by the rollout's budgets, the env may score them now
    for k, (e, was_closed) in enumerate(zip(live, closed)):
        e.info = steps.infos[k]
        e.scores.append(float(e.info["score"]))
        e.rewards.append(steps.rewards[k].tolist())
        if steps.done[k]:
            e.done, e.truncated = True, steps.truncated[k]
            continue
        if last:
            e.done = e.truncated = True
            ended.append(e)
            continue
        segments = [a.chat_continuation(o, c) for a, o, c in zip(agents, steps.observations[k], was_closed)]
        budget = settings.max_context_tokens - settings.sampling.max_new_tokens
        if any(len(ids) + len(seg) > budget for ids, seg in zip(e.ids, segments)):
            e.done = e.truncated = True  # the overflow policy: end as truncated, keep its reward
            ended.append(e)
            continue
        for i, seg in enumerate(segments):
            e.ids[i] += seg
            e.mask[i] += [0] * len(seg)
        going.append(e)
    for e, keys in zip(going, env_call(lambda: _anchor_keys(env, going, settings))):
        _add_keys(e, e.state.observations, keys, settings.anchor)
    for e, ending in zip(ended, env_call(lambda: env.end([e.state for e in ended]))):
        if ending is not None:
            e.info = ending.info
            e.scores[-1] = float(ending.info["score"])
            e.rewards[-1] = list(ending.rewards)
    clock["generate_s"] += t1 - t0
    clock["env_s"] += time.perf_counter() - t1


def _generate_replies(agents, live: list[_Live], turn: int, settings: EpisodeSettings, engine, clock: dict):
    """ONE batched generation per model over the live episodes: each episode's action texts (one per
    agent) and whether each reply closed with the end token; the reply tokens appended. Episodes with a
    sampling stream (``turns: independent``) seed each request by episode, agent and turn."""
    n = len(agents)
    texts: list[list[str]] = [[""] * n for _ in live]  # [episode][agent]
    closed: list[list[bool]] = [[True] * n for _ in live]
    groups = roles_by_model(agents)
    calls = [(agents[roles[0]], [e.ids[i] for i in roles for e in live], 1) for roles in groups]
    seeds = None
    if all(e.seed is not None for e in live):
        seeds = [[stream_seed(e.seed, i, turn) for i in roles for e in live] for roles in groups]
    outputs = engine.generate_team(calls, settings.sampling, seeds)
    for roles, out in zip(groups, outputs):
        agent = agents[roles[0]]
        decoded = agent.decode(out.completion_ids, out.completion_mask)
        for k, (ids, m) in enumerate(zip(out.completion_ids, out.completion_mask)):
            i, b = roles[k // len(live)], k % len(live)
            e, reply = live[b], ids[m.bool()].tolist()
            e.logprobs[i].append((len(e.ids[i]), None if out.logprobs is None else out.logprobs[k][m.bool()].tolist()))
            e.ids[i] += reply
            e.mask[i] += [1] * len(reply)
            e.ends[i].append(len(e.ids[i]) - 1)
            e.replies[i].append(decoded[k])
            texts[b][i] = (
                agent.read_reply(reply)  # the calls, read from the reply as generated
                if agent.tool_format is not None
                else action_text(decoded[k], settings.reasoning, agent.opens_reasoning)
            )
            closed[b][i] = reply[-1] == agent.eos_token_id
            clock["generated"] += len(reply)
    return texts, closed


def _anchor_keys(env: Env, episodes: list[_Live], settings: EpisodeSettings) -> list[str | None]:
    states = [e.state for e in episodes]
    return env.anchor_keys(states) if settings.anchor == "state" else [None] * len(states)


def _add_keys(e: _Live, observations: list[str], state: str | None, anchor: str) -> None:
    """The anchor key of the state each agent acts from next: the env's canonical state (shared by
    the agents) or the agent's own observation."""
    state = state if anchor == "state" else None
    for i, observation in enumerate(observations):
        e.keys[i].append(f"state:{state}" if state is not None else f"observation:{observation}")


def _anchor_ids(keys: list[list[str]], T: int) -> torch.Tensor:
    """``[B, T]`` ids of the rows' turn keys (equal keys, equal ids), -1 after a row's end."""
    ids: dict[str, int] = {}
    out = torch.full((len(keys), T), -1, dtype=torch.long)
    for b, row in enumerate(keys):
        out[b, : len(row)] = torch.tensor([ids.setdefault(key, len(ids)) for key in row], dtype=torch.long)
    return out


def _batches(agents, episodes: list[_Live], num_tasks: int, group_size: int, stats: dict) -> list[EpisodeBatch]:
    """One left-padded batch per agent, the outcome fields shared."""
    T = max(len(e.scores) for e in episodes)
    scores = torch.tensor([e.scores + [e.scores[-1]] * (T - len(e.scores)) for e in episodes])
    info = [e.info for e in episodes]
    shared = dict(
        scores=scores,
        won=torch.tensor([bool(i["won"]) for i in info]),
        lost=torch.tensor([bool(i["lost"]) for i in info]),
        truncated=torch.tensor([e.truncated for e in episodes]),
        max_score=torch.tensor([float(i["max_score"]) for i in info]),
        num_turns=torch.tensor([len(e.scores) for e in episodes]),
        group_ids=torch.arange(num_tasks).repeat_interleave(group_size),
        stats=stats,
    )
    batches = []
    for i, agent in enumerate(agents):
        device = next(agent.model.parameters()).device
        input_ids, attention_mask = left_pad([e.ids[i] for e in episodes], agent.pad_token_id, device)
        loss_mask, _ = left_pad([e.mask[i] for e in episodes], 0, device)
        ends = torch.full((len(episodes), T), -1, dtype=torch.long)
        for b, e in enumerate(episodes):
            ends[b, : len(e.ends[i])] = torch.tensor(e.ends[i]) + input_ids.shape[1] - len(e.ids[i])
        batches.append(
            EpisodeBatch(
                rollout_logprobs=_rollout_logprobs(
                    [e.logprobs[i] for e in episodes], input_ids.shape[1], [len(e.ids[i]) for e in episodes]
                ),
                input_ids=input_ids,
                attention_mask=attention_mask,
                loss_mask=loss_mask,
                end_positions=ends,
                replies=[e.replies[i] for e in episodes],
                anchors=_anchor_ids([e.keys[i][: len(e.scores)] for e in episodes], T),
                rewards=_env_rewards(episodes, i, T, group_size),
                **shared,
            )
        )
    return batches


def _env_rewards(episodes: list[_Live], agent: int, T: int, group_size: int) -> torch.Tensor:
    """``[B, T]``: agent ``agent``'s reward of each turn (0 after an episode's end; a skipped reward
    gets its group's mean at that turn)."""
    out = torch.zeros(len(episodes), T)
    for b, e in enumerate(episodes):
        out[b, : len(e.rewards)] = torch.tensor([r[agent] for r in e.rewards])
    return neutral_fill(out.view(-1, group_size, T)).view(len(episodes), T)


def _rollout_logprobs(replies, width: int, lengths: list[int]) -> torch.Tensor | None:
    """``[B, width]`` (left-padded rows of ``lengths`` tokens): each reply's engine log-probs at its
    tokens, 0 elsewhere; None when the engine gave none for some reply."""
    out = torch.zeros(len(replies), width)
    for b, (row, length) in enumerate(zip(replies, lengths)):
        for start, values in row:
            if values is None:
                return None
            offset = width - length + start
            out[b, offset : offset + len(values)] = torch.tensor(values)
    return out


def render_episode(batches: list[EpisodeBatch], agents: list[Agent], row: int = 0, chars: int = 400) -> str:
    """Episode ``row`` as Markdown (TensorBoard's text tab): its outcome, then per turn each
    agent's observation and reply (its own token sequence, decoded in pieces: what the environment
    said, what the agent sampled) and the turn's reward; each piece clipped to ``chars``."""
    first = batches[0]
    outcome = (
        "won" if first.won[row] else "lost" if first.lost[row] else "truncated" if first.truncated[row] else "ended"
    )
    rewards = first.rewards[row].tolist() if first.rewards is not None else []
    lines = [
        f"**episode {row}** of task {int(first.group_ids[row])}: {outcome} after {int(first.num_turns[row])} turns\n"
    ]
    pieces = [_pieces(b, row, a) for b, a in zip(batches, agents)]
    for turn in range(int(first.num_turns[row])):
        reward = f", reward **{rewards[turn]:.3f}**" if turn < len(rewards) else ""
        lines.append(f"- turn {turn}{reward}")
        for i, agent_pieces in enumerate(pieces):
            if turn < len(agent_pieces):
                observation, reply = agent_pieces[turn]
                lines.append(f"    - agent {i} saw: {markdown_line(observation, chars)}")
                lines.append(f"    - agent {i} replied: {markdown_line(reply, chars)}")
    return "\n".join(lines)


def _pieces(batch: EpisodeBatch, row: int, agent: Agent) -> list[tuple[str, str]]:
    """(observation, reply) texts of each turn of one row: the runs of ``loss_mask`` 0 and 1."""
    ids, own = (
        batch.input_ids[row][batch.attention_mask[row].bool()],
        batch.loss_mask[row][batch.attention_mask[row].bool()],
    )
    runs, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or own[k] != own[start]:
            runs.append((int(own[start]), agent.tokenizer.decode(ids[start:k].tolist(), skip_special_tokens=True)))
            start = k
    turns, observation = [], ""
    for is_reply, text in runs:
        if is_reply:
            turns.append((observation, text))
            observation = ""
        else:
            observation += text
    return turns
