"""The environment protocol that rollouts drive.

A *joint* environment is stateless: its state is a branch's histories, so the tree branches it
for free and an episode is one branch. Per task it gives every agent a first prompt; per turn it
scores all joint actions of all open nodes in ONE batched call (rewards plus per-level metrics),
and builds the next prompts of all branches in ONE batched call. CoMLRL's pair "reward function +
external transition" is exactly this (``FunctionEnv``); code tasks are ``envs.code.CodeEnv``.

The reward-call contract (``call_reward``) is the env's too: what a reward function may return,
how a raising or NaN reward is reported or skipped, is checked here, once, for every rollout.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.tasks import load_tasks, template_fields

RewardFn = Callable[..., Sequence[float] | Mapping[str, Sequence[float]]]


class JointEnv(ABC):
    cloneable = True
    """Stateless: a branch is its histories, so branching never copies anything."""
    stateful = False
    """A game whose nodes hold states (``envs.game.GameEnv``); a stateless env's state is its histories."""

    @property
    @abstractmethod
    def num_agents(self) -> int: ...

    def load_tasks(self, source: str, field: str) -> list[dict]:
        """Task rows of ``source`` (a file path by default; an env may know dataset names)."""
        return load_tasks(source, field, self.required_fields())

    def required_fields(self) -> set[str]:
        return set()

    @abstractmethod
    def prompts(self, task: dict) -> list[str]:
        """reset: each agent's first prompt for ``task``."""

    @abstractmethod
    def reward(
        self, agent_completions: list[list[str]], tasks: list[dict]
    ) -> Sequence[float] | Mapping[str, Sequence[float]]:
        """step, scoring part: ``agent_completions[agent][j]`` is joint action j on ``tasks[j]``.
        One float per joint action, one list per joint action (per agent), or a mapping with key
        ``reward`` and further per-joint-action metrics."""

    def transition(
        self,
        *,
        task: list[dict],
        prompt: list[str],
        agent_completions: list[list[str]],
        num_agents: int,
        prompt_history_per_agent: list[list[list[str]]],
        response_history_per_agent: list[list[list[str]]],
    ) -> list[list[str]]:
        """step, observation part, batched over branches: every argument is a list with one entry
        per branch (its task row, the task's prompt text - the row's ``data.transition_prompt_field``,
        "" where it has none -, this turn's completions, the histories, each agent's first prompt
        first); returns each branch's next prompt per agent."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no transition")

    def transition_metrics(self) -> dict[str, float]:
        """Metrics of the last ``transition`` call (e.g. how often an expert's reply was malformed),
        logged per turn as ``turn_<t>/<name>``; none by default."""
        return {}

    @property
    def has_transition(self) -> bool:
        return type(self).transition is not JointEnv.transition

    @property
    def transition_name(self) -> str:
        """How errors name the transition."""
        return type(self).transition.__qualname__

    @property
    def reward_name(self) -> str:
        """How errors name the reward."""
        return type(self).reward.__qualname__

    def demonstration(self, task: dict) -> list[list[dict]]:
        """An expert trajectory of ``task`` for SFT: one chat per agent, the env's prompts as user
        messages and the expert's replies as assistant messages (``lit_marl/rollout/demos.py``;
        ``scripts/make_demos.py`` writes them). Environments that have an expert implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no expert: it cannot yield demonstrations")


class FunctionEnv(JointEnv):
    """Prompt templates + an importable reward function (+ an external transition)."""

    def __init__(
        self,
        agent_prompts: list[str],
        reward_fn,
        transition=None,
        transition_kwargs: dict | None = None,
        batched_transition: bool = False,
    ):
        self.agent_prompts = list(agent_prompts)
        self.reward_fn = reward_fn
        self.batched_transition = batched_transition
        self.transition_fn = None
        self._fields = set().union(*(template_fields(t) for t in self.agent_prompts))
        if transition is not None:
            try:
                inspect.signature(transition).bind_partial(**(transition_kwargs or {}))
            except TypeError as err:
                name = getattr(transition, "__qualname__", repr(transition))
                raise ConfigError(f"data.transition_kwargs={transition_kwargs!r} do not fit {name}: {err}") from err
            self.transition_fn = functools.partial(transition, **(transition_kwargs or {}))

    @property
    def num_agents(self) -> int:
        return len(self.agent_prompts)

    def required_fields(self) -> set[str]:
        return self._fields

    def prompts(self, task: dict) -> list[str]:
        return [t.format(**task) for t in self.agent_prompts]

    def reward(self, agent_completions, tasks):
        return self.reward_fn(agent_completions=agent_completions, tasks=tasks)

    @property
    def has_transition(self) -> bool:
        return self.transition_fn is not None

    @property
    def transition_name(self) -> str:
        return getattr(self.transition_fn.func, "__qualname__", repr(self.transition_fn.func))

    @property
    def reward_name(self) -> str:
        """The user's function, ``module:name`` (what ``data.reward_fn`` names)."""
        fn = getattr(self.reward_fn, "func", self.reward_fn)
        qualname = getattr(fn, "__qualname__", repr(fn))
        module = getattr(fn, "__module__", None)
        return f"{module}:{qualname}" if module else qualname

    def transition(self, *, task, num_agents, **branches):
        """CoMLRL's transition interface has no ``task``: called once per branch, or once for all
        branches when it is ``batched_transition``."""
        if self.batched_transition:
            return self.transition_fn(num_agents=num_agents, **branches)
        return [
            self.transition_fn(num_agents=num_agents, **{key: values[b] for key, values in branches.items()})
            for b in range(len(task))
        ]


# --------------------------------------------------------------------------- the reward-call contract
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
    """``fn(**kwargs)``, but raise ``CallTimeout`` when it has not returned after ``timeout_s``
    seconds (None: wait for ever). The call runs in a daemon thread, which Python cannot stop: a
    call that never returns keeps it (and what it holds) until the process ends; the run itself
    goes on or stops, as the caller's policy says."""
    if timeout_s is None:
        return fn(**kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    worker = threading.Thread(target=target, name=f"lit_marl {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise CallTimeout(f"{what} did not return within {timeout_s:g} s: {fix}")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _reward_once(
    reward_fn: RewardFn, agent_completions, tasks, turn, name, timeout_s=None
) -> tuple[torch.Tensor, dict]:
    try:
        out = call_with_timeout(
            reward_fn,
            timeout_s,
            f"reward function {name} (data.reward_fn or the env's reward) at turn {turn} on tasks {tasks[:3]!r:.200}",
            "raise data.reward_timeout_s if it is slow, fix it if it hangs, or set data.on_reward_error=skip",
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
            f"{turn}, e.g. for tasks {examples!r:.300}; set data.on_reward_error=skip to skip such samples instead"
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


# --------------------------------------------------------------------------- stateful environments
@dataclass
class StepResult:
    observations: list[str]
    """The next observation of each agent."""
    terminated: bool = False
    """The episode ended inside the environment (won or lost)."""
    truncated: bool = False
    """The environment cut the episode short (its own step limit)."""
    info: dict = field(default_factory=dict)
    """``won``, ``lost``, ``score`` (cumulative) and ``max_score`` at least."""


class Env(ABC):
    """A stateful environment, one instance per episode: ``reset(task)`` gives each agent its first
    observation, ``step(actions)`` (one text per agent) the next ones. Rewards are derived from
    ``info`` (``won``, ``score``, ``max_score``) by the rollout's ``reward_density``, so every env
    is scored the same way."""

    num_agents: int = 1
    cloneable: bool = False
    """Whether ``clone()`` gives an independent copy (for branching a tree mid-episode)."""

    @abstractmethod
    def reset(self, task: dict) -> list[str]: ...

    @abstractmethod
    def step(self, actions: list[str]) -> StepResult: ...

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The expert's play of ``task``: per turn, one action text per agent (an optimal solver, a
        game's walkthrough, a recorded fix). Environments that have an expert implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no expert: it cannot yield demonstrations")

    def demonstration(self, task: dict) -> list[list[dict]]:
        """The expert's episode, played in this environment, as one chat per agent: the observations
        as user messages, the actions as assistant messages - the turns an RL episode renders. An
        expert that does not win is an error, never a demonstration."""
        observations, turns = self.reset(task), self.expert_turns(task)
        chats: list[list[dict]] = [[] for _ in range(self.num_agents)]
        for t, actions in enumerate(turns):
            for chat, observation, action in zip(chats, observations, actions):
                chat += [{"role": "user", "content": observation}, {"role": "assistant", "content": action}]
            result = self.step(actions)
            if result.terminated or result.truncated:
                if not result.info.get("won") or t != len(turns) - 1:
                    raise ValueError(f"task {task!r}: the expert's play ended at turn {t + 1} without a win")
                return chats
            observations = result.observations
        raise ValueError(f"task {task!r}: the expert's {len(turns)} turns did not finish the episode")

    def state_key(self) -> str | None:
        """A canonical key of the current state: equal for equal states whatever led to them (the
        anchor of step-level groups, ``docs/credit.md``), or None when the env has none (the anchor
        is then the agent's observation text). Any function of the episode's history so far keeps
        the step-level estimate unbiased; a finer key groups less, a coarser one more."""
        return None

    def finish(self) -> dict | None:
        """The rollout ended the episode (its turn or context budget ran out): the env's final
        ``info`` when ending changes it (an env that scores on ``submit`` scores now), else None
        (the last step's info stands)."""
        return None

    def close(self) -> None:
        """Release what the episode holds (a workspace, a process); called once it is over, also
        when it raised. Nothing by default."""
        return None

    def clone(self) -> "Env":
        if not self.cloneable:
            raise TypeError(f"{type(self).__name__} cannot be cloned: replay the action prefix instead")
        return copy.deepcopy(self)


REGISTRY: dict[str, type[Env]] = {}


def register(name: str):
    """Class decorator: make an environment selectable by ``name`` in YAML (``data.env: name``)."""

    def add(cls: type[Env]) -> type[Env]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"environment name {name!r} is taken by {REGISTRY[name].__qualname__}")
        REGISTRY[name] = cls
        return cls

    return add


def step_all(envs: list[Env], actions: list[list[str]], pool: ThreadPoolExecutor | None = None) -> list[StepResult]:
    """Step many episodes at once (in a thread pool when given), results in order."""
    if pool is None:
        return [env.step(a) for env, a in zip(envs, actions)]
    return list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs, actions)))
