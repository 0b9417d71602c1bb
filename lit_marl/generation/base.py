"""What every engine shares: the ``Generation`` it returns (token ids in, token ids out), the
padding helpers, and the ``Engine`` interface the rollouts call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lit_marl.agents import Agent


@dataclass
class Generation:
    """Row ``i * num_samples + k`` holds sample k of prompt i."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded after the end token
    completion_mask: torch.Tensor  # [B, C] 1 on generated tokens up to and including the end token
    num_samples: int = 1  # rows per prompt

    def rows(self, index: slice) -> "Generation":
        return Generation(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.completion_mask[index],
            self.num_samples,
        )

    @property
    def num_generated_tokens(self) -> int:
        return int(self.completion_mask.sum())


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and mask ``[len(sequences), width]`` (default width: the longest sequence)."""
    width = max(len(s) for s in sequences) if width is None else width
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long, device=device)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def mask_through_first(ids: torch.Tensor, token_id: int) -> torch.Tensor:
    """1 on every position up to and including the first ``token_id`` of each row (all if none)."""
    hit = (ids == token_id).long()
    return ((hit.cumsum(-1) - hit) == 0).long()


GenerationCall = tuple[Agent, list[list[int]], int]
"""One agent's share of a turn: ``(agent, prompts, num_samples)``."""


class Engine(Protocol):
    """What the rollouts call. ``generate``: one batched generation for one agent's prompts (row
    ``i * num_samples + k`` of the result is sample k of prompt i). ``generate_team``: a turn's
    calls for every model of the team at once (one ``Generation`` per call, in order), so an
    engine may decode the agents together; ``generate_each`` is the plain loop."""

    name: str

    def generate(
        self,
        agent: Agent,
        prompts: list[list[int]],
        num_samples: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> Generation: ...

    def generate_team(
        self,
        calls: list[GenerationCall],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
    ) -> list[Generation]: ...


def generate_each(engine, calls: list[GenerationCall], *args, **kwargs) -> list[Generation]:
    """``generate_team`` as one ``generate`` per call."""
    return [engine.generate(agent, prompts, n, *args, **kwargs) for agent, prompts, n in calls]
