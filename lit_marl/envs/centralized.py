"""Centralized play (CoMLRL's centralized MAGRPO): ONE joint actor writes every role's output in one
completion; the joint text is split into roles only for the reward.

``CentralizedEnv`` wraps an N-agent environment as a one-agent one: its prompt is the adapter's
``build_prompt(task, agent_prompts)``, and its reward parses each completion with
``parse_completion(text, task, num_agents)`` and scores the roles with the N-agent reward. A
completion without every role's section is a parse failure: counted (``parse_failed``), scored
``parse_failure_reward`` (its reward metrics, e.g. ``success``, 0), never a crash. Single-turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

import torch

from lit_marl.envs.base import TextEnv
from lit_marl.envs.calls import call_reward


class ParseError(ValueError):
    """The completion holds no role section at all."""


class CentralizedAdapter(Protocol):
    def build_prompt(self, task: dict, agent_prompts: Sequence[str]) -> str: ...

    def parse_completion(self, completion: str, task: dict, num_agents: int) -> Sequence[str]: ...


class SequentialAdapter(Protocol):
    """A comparator writing the roles one after another (iterative MADPO's ``centralized_sequential``)."""

    def build_sequential_prompt(
        self, task: dict, agent_prompts: Sequence[str], agent: int, previous: Sequence[str]
    ) -> str: ...

    def parse_sequential_completion(self, completion: str, task: dict, agent: int) -> str: ...


class TaggedAdapter:
    """The stock adapter (CoMLRL's tagged format): the roles' prompts, then one ``<agent_i> ...
    </agent_i>`` section per role (0-based) is asked for; parsing takes each role's first section,
    stripped (case and spaces inside the tags ignored). A missing section is a ``ParseError``
    (CoMLRL accepts a partial answer, its missing roles empty: one section would then earn what
    the reward gives an empty line)."""

    def build_prompt(self, task: dict, agent_prompts: Sequence[str]) -> str:
        n = len(agent_prompts)
        roles = "\n\n".join(f"Agent {i} original prompt:\n{p}" for i, p in enumerate(agent_prompts))
        sections = "\n".join(f"<agent_{i}>\n...\n</agent_{i}>" for i in range(n))
        return (
            f"You are a centralized coordinator producing the separate outputs of {n} agents.\n\n"
            "Each output must satisfy its agent's original prompt. Keep the outputs separate and write "
            "nothing outside the tags.\n\n"
            f"{roles}\n\nReturn exactly one section for each agent in this format:\n{sections}\n"
        )

    def parse_completion(self, completion: str, task: dict, num_agents: int) -> list[str]:
        parts = [_section(completion, i) for i in range(num_agents)]
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise ParseError(f"no <agent_{missing[0]}> section in {completion!r:.200}")
        return parts

    def build_sequential_prompt(
        self, task: dict, agent_prompts: Sequence[str], agent: int, previous: Sequence[str]
    ) -> str:
        """Agent ``agent``'s turn: its prompt, the outputs the agents before it wrote, one section asked for."""
        shown = "\n".join(f"<agent_{i}>\n{text}\n</agent_{i}>" for i, text in enumerate(previous)) or "(none yet)"
        return (
            f"You are a centralized coordinator writing the outputs of {len(agent_prompts)} agents one at a "
            f"time. Now write agent {agent}'s output; it must satisfy agent {agent}'s prompt and fit the "
            f"outputs written so far.\n\nAgent {agent} prompt:\n{agent_prompts[agent]}\n\n"
            f"Outputs so far:\n{shown}\n\nReturn only:\n<agent_{agent}>\n...\n</agent_{agent}>\n"
        )

    def parse_sequential_completion(self, completion: str, task: dict, agent: int) -> str:
        """The ``<agent_i>`` section (a ``ParseError`` without it)."""
        part = _section(completion, agent)
        if part is None:
            raise ParseError(f"no <agent_{agent}> section in {completion!r:.200}")
        return part


def _section(completion: str, i: int) -> str | None:
    """The first ``<agent_i> ... </agent_i>`` section, stripped (case and spaces in the tags ignored)."""
    match = re.search(rf"<\s*agent_{i}\s*>(.*?)<\s*/\s*agent_{i}\s*>", completion, re.IGNORECASE | re.DOTALL)
    return match.group(1).strip() if match else None


class CentralizedEnv(TextEnv):
    """``inner`` (N agents, single-turn) played by one joint actor through ``adapter``."""

    def __init__(self, inner: TextEnv, adapter: CentralizedAdapter, parse_failure_reward: float | None = 0.0):
        """
        Args:
            inner: The N-role environment whose prompts and reward the joint actor plays (the data
                module builds it from ``data.agent_prompts`` and ``data.reward_fn``, or ``data.env``).
            adapter: Builds the joint prompt and splits a joint completion into roles (``TaggedAdapter``).
            parse_failure_reward: The reward of a completion without every role's section (null: its roles
                scored as empty strings, CoMLRL's behaviour).
        """
        self.inner = inner
        self.adapter = adapter
        self.parse_failure_reward = parse_failure_reward
        self.roles = inner.num_agents

    @property
    def num_agents(self) -> int:
        return 1

    @property
    def reward_name(self) -> str:
        return f"{self.inner.reward_name} (centralized)"

    def load_tasks(self, source: str, field: str) -> list[dict]:
        return self.inner.load_tasks(source, field)

    def prompts(self, task: dict) -> list[str]:
        prompt = self.adapter.build_prompt(task, self.inner.prompts(task))
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"the centralized adapter's build_prompt returned {prompt!r:.100}: it must be a non-empty string"
            )
        return [prompt]

    def split(self, completion: str, task: dict) -> list[str] | None:
        """The roles' outputs, or None on a parse failure; an adapter that returns the wrong number of
        roles is a bug in the adapter and raises."""
        try:
            parts = self.adapter.parse_completion(completion, task, self.roles)
        except ParseError:
            return None
        if isinstance(parts, str) or len(parts) != self.roles or not all(isinstance(p, str) for p in parts):
            raise ValueError(
                f"the centralized adapter's parse_completion must return {self.roles} strings, got {parts!r:.200}"
            )
        return list(parts)

    def reward(self, agent_completions: list[list[str]], tasks: list[dict]) -> dict[str, list[float]]:
        """Every joint text's roles scored by the inner reward (a parse failure's roles as empty
        strings, so the reward's metrics keep their keys); a failure then gets ``parse_failure_reward``
        and 0 for every metric (it passed no check), unless that is null (CoMLRL: the empty roles' score)."""
        (joint,) = agent_completions
        splits = [self.split(text, task) for text, task in zip(joint, tasks)]
        roles = [[(split or [""] * self.roles)[i] for split in splits] for i in range(self.roles)]
        samples: dict[str, torch.Tensor] = {}
        rewards, _ = call_reward(self.inner.reward, roles, tasks, samples=samples)
        rewards = rewards.mean(dim=1) if rewards.dim() == 2 else rewards  # per-role rewards: the team mean
        failed = [split is None for split in splits]
        out = {"reward": rewards.tolist(), **{key: values.tolist() for key, values in samples.items()}}
        if self.parse_failure_reward is not None:
            for j in (j for j, f in enumerate(failed) if f):
                for key in out:
                    out[key][j] = 0.0
                out["reward"][j] = float(self.parse_failure_reward)
        out["parse_failed"] = [float(f) for f in failed]
        return out
