"""Comparators that answer in text: the responses of another writer (an HTTP endpoint, a model
writing every role, roles written one after another) as rows of the policy.

A ``TextRole`` stands in for a role's agent in a rollout: it renders prompts with the policy agent's
tokenizer and chat template (so each row's prompt is the policy's own) and records the prompt
texts. ``TextEngine`` gets one call per role for the turn, asks its ``writer`` for texts in one of
three modes (``comparator_generation_mode``, CoMLRL's names) and returns them tokenized by the
policy, closed by its end token:

- ``decentralized``: each role's prompt to the writer as that role, K texts per prompt;
- ``centralized``: per task one joint prompt (the adapter's ``build_prompt(task, agent_prompts)``)
  to the writer as role ``centralized_index``, K joint texts, each split into roles by
  ``parse_completion`` (a joint text may use every role's token budget);
- ``centralized_sequential``: roles in order; for role i and candidate k the adapter's
  ``build_sequential_prompt(task, agent_prompts, i, outputs of roles < i in candidate k)``, one
  text each, cut out by ``parse_sequential_completion``.

A writer that cannot answer (a timeout) and a text the adapter cannot parse skip that candidate:
``skipped[role]`` lists the rows (``prompt * K + k``) of the last rollout; the comparator marks
their joint candidates so they form no pair.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, Protocol

import torch

from lit_marl.generation.base import Generation, GenerationCall, Sampling, TrainerWeights, left_pad

GenerationMode = Literal["decentralized", "centralized", "centralized_sequential"]


class Writer(Protocol):
    """Texts for prompts: per prompt ``n`` texts, or None where it could not answer."""

    def complete(
        self, prompts: list[str], role: int, tasks: list[dict], n: int, sampling: Sampling
    ) -> list[list[str] | None]: ...


class TextRole:
    """A role of a text comparator's rollout, bound to the step's tasks (single-turn: prompt i is task i's)."""

    def __init__(self, agent, role: int, tasks: list[dict]):
        self.agent, self.role, self.tasks = agent, role, tasks
        self.texts: list[str] = []

    def encode_prompt(self, text: str, raw: bool = False) -> list[int]:
        self.texts.append(text)
        return self.agent.encode_prompt(text, raw)

    @property
    def tokenizer(self):
        return self.agent.tokenizer

    @property
    def eos_token_id(self) -> int:
        return self.agent.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.agent.pad_token_id

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return self.agent.decode(ids, mask)


class ModelWriter:
    """Local models as a writer: role i's texts from ``agents[i]`` (its own chat template), sampled
    by ``engine``; decoded without special tokens."""

    def __init__(self, agents: list, engine):
        self.agents, self.engine = agents, engine

    def complete(self, prompts, role, tasks, n, sampling):
        agent = self.agents[role]
        encoded = [agent.encode_prompt(p) for p in prompts]
        (gen,) = self.engine.generate_team([(agent, encoded, n)], sampling)
        texts = agent.decode(gen.completion_ids, gen.completion_mask)
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]


class TextEngine(TrainerWeights):
    """The ``Engine`` interface over a text ``writer`` in one generation mode (module docstring)."""

    name = "text"

    def __init__(
        self, writer: Writer, mode: GenerationMode = "decentralized", adapter=None, centralized_index: int = 0
    ):
        self.writer, self.mode, self.adapter, self.centralized_index = writer, mode, adapter, centralized_index
        self.skipped: dict[int, list[int]] = {}

    def generate_team(self, calls: list[GenerationCall], sampling: Sampling, seeds=None) -> list[Generation]:
        """``seeds`` (per-task sampling streams) do not reach the writer: it samples with its own randomness."""
        roles = [role for role, _, _ in calls]
        n = calls[0][2]
        prompts = [role.texts for role in roles]
        for role in roles:
            role.texts = []
        tasks = roles[0].tasks
        if self.mode == "decentralized":
            answers = [self.writer.complete(p, r.role, tasks, n, sampling) for p, r in zip(prompts, roles)]
        elif self.mode == "centralized":
            answers = self._centralized(prompts, tasks, n, sampling)
        else:
            answers = self._sequential(prompts, tasks, n, sampling)
        out = []
        for (role, ids, _), per_prompt in zip(calls, answers):  # per_prompt[i][k]: text or None (skipped)
            texts = [t for per in per_prompt for t in (per if per is not None else [None] * n)]
            self.skipped[role.role] = [r for r, t in enumerate(texts) if t is None]
            rows = [_tokens(role, t if t is not None else "", sampling.max_new_tokens) for t in texts]
            out.append(_generation(role, ids, n, rows))
        return out

    def _centralized(self, prompts, tasks, n, sampling: Sampling):
        """``[role][task][k]``: the joint texts of each task split into roles (None: skipped)."""
        num_roles = len(prompts)
        joint = [self.adapter.build_prompt(task, [p[t] for p in prompts]) for t, task in enumerate(tasks)]
        joint_sampling = replace(sampling, max_new_tokens=sampling.max_new_tokens * num_roles)  # every role's budget
        texts = self.writer.complete(joint, self.centralized_index, tasks, n, joint_sampling)
        answers = [[[] for _ in tasks] for _ in range(num_roles)]
        for t, (task, candidates) in enumerate(zip(tasks, texts)):
            for k in range(n):
                parts = None
                if candidates is not None:
                    parts = _parsed(self.adapter.parse_completion, candidates[k], task, num_roles)
                for i in range(num_roles):
                    answers[i][t].append(parts[i] if parts is not None else None)
        return answers

    def _sequential(self, prompts, tasks, n, sampling: Sampling):
        """``[role][task][k]``: role after role, each candidate's earlier outputs in its prompt."""
        outputs = [[[] for _ in range(n)] for _ in tasks]  # [task][k]: texts of the roles so far (None: skipped)
        for i in range(len(prompts)):
            asks, where = [], []
            for t, task in enumerate(tasks):
                for k in range(n):
                    if None not in outputs[t][k]:
                        asks.append(
                            self.adapter.build_sequential_prompt(task, [p[t] for p in prompts], i, outputs[t][k])
                        )
                        where.append((t, k))
            replies = self.writer.complete(asks, i, [tasks[t] for t, _ in where], 1, sampling)
            done = {}
            for (t, k), reply in zip(where, replies):
                if reply is not None:
                    done[t, k] = _parsed(self.adapter.parse_sequential_completion, reply[0], tasks[t], i)
            for t in range(len(tasks)):
                for k in range(n):
                    outputs[t][k].append(done.get((t, k)))
        return [[[outputs[t][k][i] for k in range(n)] for t in range(len(tasks))] for i in range(len(prompts))]


def _parsed(parse, *args):
    """The adapter's ``parse(*args)``, or None where it could not parse the text (a skipped candidate)."""
    try:
        return parse(*args)
    except ValueError:  # envs.centralized.ParseError and any adapter's own ValueError
        return None


def _tokens(role: TextRole, text: str, max_new_tokens: int) -> list[int]:
    """The text as the policy's tokens, closed by its end token; cut (no end token) past the budget."""
    ids = role.tokenizer(text, add_special_tokens=False)["input_ids"] + [role.eos_token_id]
    return ids[:max_new_tokens]


def _generation(role: TextRole, prompts: list[list[int]], n: int, rows: list[list[int]]) -> Generation:
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(n)], role.pad_token_id, "cpu")
    completion = torch.full((len(rows), max(len(r) for r in rows)), role.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(completion)
    for r, ids in enumerate(rows):
        completion[r, : len(ids)], mask[r, : len(ids)] = torch.tensor(ids, dtype=torch.long), 1
    return Generation(prompt_ids, prompt_mask, completion, mask, n)
