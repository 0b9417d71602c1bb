"""The environment protocol that rollouts drive.

A *joint* environment is stateless: its state is a branch's histories, so the tree branches it
for free and an episode is one branch. Per task it gives every agent a first prompt; per turn it
scores all joint actions of all open nodes in ONE batched call (rewards plus per-level metrics),
and builds the next prompts of all branches in ONE batched call. CoMLRL's pair "reward function +
external transition" is exactly this (``FunctionEnv``); code tasks are ``envs.code.CodeEnv``.
"""

from __future__ import annotations

import copy
import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lit_marl import ConfigError


class JointEnv(ABC):
    cloneable = True
    """Stateless: a branch is its histories, so branching never copies anything."""

    @property
    @abstractmethod
    def num_agents(self) -> int: ...

    def load_tasks(self, source: str, field: str) -> list[dict]:
        """Task rows of ``source`` (a file path by default; an env may know dataset names)."""
        from lit_marl.data import load_tasks

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
        prompt: list[list[str]],
        agent_completions: list[list[str]],
        num_agents: int,
        prompt_history_per_agent: list[list[list[str]]],
        response_history_per_agent: list[list[list[str]]],
    ) -> list[list[str]]:
        """step, observation part, batched over branches: every argument is a list with one entry
        per branch (its task, first prompts, this turn's completions, histories); returns each
        branch's next prompt per agent."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no transition")

    @property
    def has_transition(self) -> bool:
        return type(self).transition is not JointEnv.transition

    def demonstration(self, task: dict) -> list[list[dict]]:
        """An expert trajectory of ``task`` for SFT: one chat per agent, the env's prompts as user
        messages and the expert's replies as assistant messages (``lit_marl/demos.py``;
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
        from lit_marl.data import template_fields

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

    def transition(self, *, task, num_agents, **branches):
        """CoMLRL's transition interface has no ``task``: called once per branch, or once for all
        branches when it is ``batched_transition``."""
        if self.batched_transition:
            return self.transition_fn(num_agents=num_agents, **branches)
        return [
            self.transition_fn(num_agents=num_agents, **{key: values[b] for key, values in branches.items()})
            for b in range(len(task))
        ]


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


def make_env(name: str, kwargs: dict | None = None, field_name: str = "data.env") -> Env:
    if name not in REGISTRY:
        import lit_marl.envs  # noqa: F401  (registers the built-in environments)
    if name not in REGISTRY:
        raise ConfigError(f"{field_name}={name!r}: not a registered environment; choose one of {sorted(REGISTRY)}")
    try:
        return REGISTRY[name](**(kwargs or {}))
    except TypeError as err:
        raise ConfigError(f"{field_name}_kwargs={kwargs!r} do not fit environment {name!r}: {err}") from err


def step_all(envs: list[Env], actions: list[list[str]], pool: ThreadPoolExecutor | None = None) -> list[StepResult]:
    """Step many episodes at once (in a thread pool when given), results in order."""
    if pool is None:
        return [env.step(a) for env, a in zip(envs, actions)]
    return list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs, actions)))
