"""The contract of calling user code from a rollout: a reward function or a transition is called
once per turn over every joint action (or branch), bounded in time, its output checked; what a
raising or NaN reward does is decided here, once, for every environment and rollout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lit_marl.fields import PositiveFloat, PositiveInt, check_dataclass
from lit_marl.timeouts import TimedOut, timed

RewardFn = Callable[..., Sequence[float] | Mapping[str, Sequence[float]]]


@dataclass(frozen=True)
class CallSettings:
    """How a rollout calls a text environment's reward function and transition (``data.reward_calls``)."""

    on_reward_error: Literal["raise", "skip"] = "raise"
    """``raise`` stops on a reward function that raises or returns NaN/inf, naming the task and turn;
    ``skip`` gives such samples a neutral reward (no advantage) and reports their fraction as the
    metric ``skipped_reward_frac`` (``reward_batch_failures``: batch calls that failed and were
    retried per joint action; ``reward_timeouts``: batch calls skipped for their time)."""
    reward_timeout_s: PositiveFloat | None = 600.0
    """Time limit of one batched reward call (None: none). Past it the run stops naming the reward,
    or under ``on_reward_error: skip`` the batch is skipped."""
    transition_timeout_s: PositiveFloat | None = 600.0
    """Time limit of one batched transition call (None: none); past it the run stops naming the
    transition."""
    transition_prompt_field: str = "prompt"
    """The task row's field the transition receives as ``prompt`` (the task's prompt text, as CoMLRL
    passes ``batch_item["prompt"]``); a row without it passes the empty string, as CoMLRL does, and a
    warning names the field."""
    max_skipped_steps: PositiveInt = 3
    """Under ``on_reward_error: skip``, stop after this many training steps in a row whose every
    reward was skipped (nothing is being learned)."""

    def __post_init__(self):
        check_dataclass("data.reward_calls", self)


MAX_REWARD = 1e15
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class RewardError(ValueError):
    """The reward function raised, or scored a joint action NaN/inf."""


class CallTimeout(RewardError):
    """A reward function or transition did not return within its time limit."""


def call_with_timeout(fn: Callable, timeout_s: float | None, what: str, fix: str, **kwargs):
    """``fn(**kwargs)``, but raise ``CallTimeout`` (saying ``fix``) when it has not returned after
    ``timeout_s`` seconds (None: wait for ever): ``timeouts.timed``."""
    try:
        return timed(fn, timeout_s, what, **kwargs)
    except TimedOut as err:
        raise CallTimeout(f"{err}: {fix}") from None


def _reward_once(
    reward_fn: RewardFn, agent_completions, tasks, turn, name, timeout_s=None
) -> tuple[torch.Tensor, dict]:
    try:
        out = call_with_timeout(
            reward_fn,
            timeout_s,
            f"reward function {name} (data.reward_fn or the env's reward) at turn {turn} on tasks {tasks[:3]!r:.200}",
            "raise data.reward_calls.reward_timeout_s if it is slow, fix it if it hangs, or set "
            "data.reward_calls.on_reward_error=skip",
            agent_completions=agent_completions,
            tasks=tasks,
        )
    except CallTimeout:
        raise
    except Exception as err:
        raise RewardError(
            f"reward function {name} raised {type(err).__name__}: {err} at turn {turn} on tasks {tasks[:3]!r:.300}"
        ) from err
    extra = {}
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise ValueError(f"reward function {name} returned a mapping without the key 'reward'")
        extra = {k: v for k, v in out.items() if k != "reward"}
        out = out["reward"]
    try:
        rewards = torch.as_tensor([list(r) if isinstance(r, Sequence) else r for r in out], dtype=torch.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"reward function {name} returned {out!r:.200}: give floats, or one list per joint action"
        ) from err
    num_agents = len(agent_completions)
    if rewards.dim() == 0 or len(rewards) != len(tasks):
        count = 0 if rewards.dim() == 0 else len(rewards)
        raise ValueError(
            f"reward function {name} returned {count} rewards for {len(tasks)} joint actions at turn {turn}"
        )
    if rewards.dim() > 2 or (rewards.dim() == 2 and rewards.shape[1] != num_agents):
        raise ValueError(
            f"reward function {name} returned rewards of shape {tuple(rewards.shape)} at turn {turn}: give one float "
            f"(joint reward) or {num_agents} floats (one per agent) for each joint action"
        )
    return rewards, extra


def call_reward(
    reward_fn: RewardFn,
    agent_completions: list[list[str]],
    tasks: list[dict],
    turn: int = 0,
    on_error: Literal["raise", "skip"] = "raise",
    timeout_s: float | None = None,
    samples: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One batched call; returns the rewards and the mean of each extra metric it reported (and,
    into ``samples`` where given, each metric's per-joint-action values, NaN where skipped).

    A reward function returns one float per joint action (a joint reward, shared by the agents) or
    one list of ``num_agents`` floats per joint action (per-agent rewards: ``[J]`` or ``[J, N]``
    comes back), or a mapping with key ``reward`` holding either and further per-joint-action
    metrics (e.g. the levels of a level-based reward).

    ``on_error="raise"`` stops on a reward that raises or is NaN/inf, naming the task and turn.
    ``"skip"`` isolates the culprits (after a raising batch call, one call per joint action),
    returns NaN for them and reports their fraction as ``skipped_reward_frac``; the tree then gives them
    a neutral reward. ``timeout_s`` bounds the batch call (a timed-out batch is skipped whole under
    ``skip``: one call per joint action would wait as long again, each); ``reward_batch_failures``
    (1 for a batch call that failed and was retried per joint action) and ``reward_timeouts`` count
    what happened.
    """
    owner = getattr(reward_fn, "__self__", None)  # an env's bound reward: the env knows its name
    name = owner.reward_name if hasattr(owner, "reward_name") else getattr(reward_fn, "__qualname__", repr(reward_fn))
    failures = {"reward_batch_failures": 0.0, "reward_timeouts": 0.0}
    try:
        rewards, extra = _reward_once(reward_fn, agent_completions, tasks, turn, name, timeout_s)
    except CallTimeout:
        if on_error == "raise":
            raise
        failures["reward_timeouts"] = 1.0
        rewards, extra = torch.full((len(tasks),), float("nan")), {}
    except RewardError:
        if on_error == "raise":
            raise
        failures["reward_batch_failures"] = 1.0
        scored = []
        for j in range(len(tasks)):
            one = [a[j : j + 1] for a in agent_completions]
            try:
                scored.append(_reward_once(reward_fn, one, tasks[j : j + 1], turn, name, timeout_s)[0][0])
            except RewardError:
                scored.append(None)
        width = next((r.shape for r in scored if r is not None), ())
        rewards = torch.stack([torch.full(width, float("nan")) if r is None else r for r in scored])
        extra = {}
    # a finite reward beyond MAX_REWARD overflows float32 in the batch's mean and variance (NaN
    # advantages), so it is as unusable as NaN
    usable = torch.isfinite(rewards) & (rewards.abs() <= MAX_REWARD)
    bad = ~usable if rewards.dim() == 1 else ~usable.all(dim=1)
    if bad.any() and on_error == "raise":
        examples = [tasks[i] for i in torch.nonzero(bad).flatten().tolist()[:3]]
        raise RewardError(
            f"reward function {name} returned a non-finite reward (NaN/inf) or one beyond +-{MAX_REWARD:g} at turn "
            f"{turn}, e.g. for tasks {examples!r:.300}; set data.reward_calls.on_reward_error=skip to skip such "
            "samples instead"
        )
    metrics = {}
    for key, values in extra.items():
        values = torch.as_tensor(list(values), dtype=torch.float32)
        good = ~bad & torch.isfinite(values)
        if not torch.isfinite(values[~bad]).all():
            _warn_once(f"reward function {name} reported a non-finite {key!r}: averaged over its finite values")
        metrics[key] = float(values[good].mean()) if good.any() else 0.0
        if samples is not None:
            samples[key] = torch.where(good, values, float("nan"))
    if on_error == "skip":
        metrics["skipped_reward_frac"] = float(bad.float().mean())
        metrics.update(failures)
    bad = bad.view(-1, *([1] * (rewards.dim() - 1)))
    return torch.where(bad, torch.full_like(rewards, float("nan")), rewards), metrics


def call_transitions(
    env, states: list, turn: int, prompt_field: str = "prompt", timeout_s: float | None = None
) -> list[list[str]]:
    """Next prompts of every branch of a turn (text states whose responses hold this turn's), in ONE
    call of the env's transition (every keyword argument a list over branches, and so is the
    result), each checked. ``prompt`` is the task's prompt, its row's ``prompt_field`` (CoMLRL's
    ``batch_item.get("prompt", "")``: the empty string where the row has no such field)."""
    if not states:
        return []
    num_agents = len(states[0].prompts)
    out = call_with_timeout(
        env.transition,
        timeout_s,
        f"transition {env.transition_name} (data.transition or the env's) after turn {turn}",
        "raise data.reward_calls.transition_timeout_s if it is slow (an expert model's edits can be), or fix it "
        "if it hangs",
        task=[state.task for state in states],
        prompt=[task_prompt(state.task, prompt_field) for state in states],
        agent_completions=[[h[-1] for h in state.responses] for state in states],
        num_agents=num_agents,
        prompt_history_per_agent=[[list(h) for h in state.prompts] for state in states],
        response_history_per_agent=[[list(h) for h in state.responses] for state in states],
    )
    name = env.transition_name
    if isinstance(out, str) or len(out) != len(states):
        raise ValueError(f"batched transition {name} returned {len(out)} results for {len(states)} branches")
    for state, prompts in zip(states, out):
        if isinstance(prompts, str) or len(prompts) != num_agents or not all(isinstance(p, str) for p in prompts):
            raise ValueError(
                f"transition {name} must return {num_agents} strings (one prompt per agent); it returned "
                f"{prompts!r:.200} after turn {turn} of task {state.task!r:.200}"
            )
    return [list(p) for p in out]


def task_prompt(task: dict, field: str = "prompt") -> str:
    """The task's prompt a transition receives: the row's ``field`` as text, "" where it has none."""
    value = task.get(field, "")
    return value if isinstance(value, str) else str(value)
