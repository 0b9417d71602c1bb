"""Per-agent rollout buffers: samples wait here, by tree node, until an update consumes them."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch

from lit_marl.rollout.batch import AgentSamples


class RolloutBuffer:
    """One agent's samples (each tree node = one sample: its G responses)."""

    def __init__(self) -> None:
        self.parts: list[AgentSamples] = []
        self.num_nodes = 0

    def __len__(self) -> int:
        return self.num_nodes

    def add(self, samples: AgentSamples) -> None:
        """Node ids become unique in the buffer (``next_group`` links follow them; a link always
        points into the same rollout, whose nodes come in one ``add``)."""
        nodes, local = torch.unique(samples.group_ids, return_inverse=True)
        next_group = samples.next_group
        if next_group is not None:
            linked = next_group >= 0
            position = torch.searchsorted(nodes, next_group.clamp(min=0))
            if linked.any() and not torch.equal(nodes[position.clamp(max=len(nodes) - 1)][linked], next_group[linked]):
                raise ValueError("RolloutBuffer.add: next_group links to a node that is not in these samples")
            next_group = torch.where(linked, position + self.num_nodes, -1)
        self.parts.append(replace(samples, group_ids=local + self.num_nodes, next_group=next_group))
        self.num_nodes += len(nodes)

    def state_dict(self) -> dict:
        """Plain tensors only (checkpoints load with ``weights_only``)."""
        return {"num_nodes": self.num_nodes, "parts": [dict(vars(part)) for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        self.parts = [AgentSamples(**part) for part in state["parts"]]
        self.num_nodes = state["num_nodes"]

    def drain(self, pad_id: int) -> AgentSamples | None:
        """Everything in the buffer as one batch; the buffer is empty afterwards."""
        if not self.parts:
            return None
        samples = AgentSamples.cat(self.parts, pad_id)
        self.parts, self.num_nodes = [], 0
        return samples


UpdateSchedule = Literal["joint", "per_turn"]


def minibatches(
    samples: AgentSamples,
    nodes_per_batch: int | None,
    generator: torch.Generator,
    schedule: UpdateSchedule = "joint",
) -> list[torch.Tensor]:
    """Row indices of the mini-batches of one update; every row is in exactly one.

    ``joint``: ``None`` makes the whole buffer one mini-batch; otherwise nodes are grouped by turn
    (a mini-batch holds one turn, so its prompts have similar lengths), shuffled within their turn,
    cut into ``nodes_per_batch`` nodes, and the mini-batches shuffled.
    ``per_turn`` (CoMLRL's): the turns in order, each its own mini-batches - its nodes shuffled and
    cut into ``nodes_per_batch`` (``None``: the whole turn) - so every turn gets at least one step.
    """
    device = samples.group_ids.device
    if nodes_per_batch is None and schedule == "joint":
        return [torch.arange(len(samples), device=device)]
    group_ids, turn_ids = samples.group_ids.cpu(), samples.turn_ids.cpu()
    batches = []
    for turn in torch.unique(turn_ids).tolist():
        nodes = torch.unique(group_ids[turn_ids == turn])
        nodes = nodes[torch.randperm(len(nodes), generator=generator)]
        for chunk in nodes.split(nodes_per_batch or len(nodes)):
            batches.append(torch.nonzero(torch.isin(group_ids, chunk)).flatten().to(device))
    if schedule == "per_turn":
        return batches
    if schedule != "joint":
        raise ValueError(f"update_schedule={schedule!r}: choose joint or per_turn")
    order = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in order]


def batch_turns(
    samples: AgentSamples | None, batches: list[torch.Tensor], schedule: UpdateSchedule
) -> list[int] | None:
    """The turn of each mini-batch of a ``per_turn`` schedule (``parallel.collectives.padded_steps``
    aligns them across ranks); None for ``joint``, whose steps need no alignment."""
    if schedule != "per_turn":
        return None
    return [] if samples is None else [int(samples.turn_ids[b[0]]) for b in batches]
