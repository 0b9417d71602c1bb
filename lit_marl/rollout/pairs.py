"""Preference pairs from scored joint candidates (MADPO, the reward model of MARLHF). Pure: no models.

Per task, K joint candidates (agent i's k-th response in candidate k, ``joint_mode: aligned``) have
one reward each. Every ordered pair (w, l) with r_w - r_l > 0 is a preference of w over l; ties give
none (equal rewards say nothing about which is better). A candidate may appear in several pairs.
"""

from __future__ import annotations

from typing import Literal

import torch

PairSelection = Literal["reward_gap", "random", "all"]


def select_pairs(
    rewards: torch.Tensor,
    selection: PairSelection = "reward_gap",
    max_pairs: int | None = 16,
    generator: torch.Generator | None = None,
) -> list[tuple[int, int]]:
    """The (chosen, rejected) candidate indices of one task from its ``[K]`` rewards.

    - ``reward_gap``: the pairs with the largest gaps first (equal gaps in (w, l) order), at most ``max_pairs``.
    - ``random``: a uniformly random subset of ``max_pairs`` pairs, drawn with ``generator`` (seeded:
      the same pairs for the same rewards and generator state).
    - ``all``: every pair, in (w, l) order; ``max_pairs`` must be None (CoMLRL's rule).

    Ties (a zero gap) and non-finite rewards never pair."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [K] (one task's candidates), got shape {tuple(rewards.shape)}")
    if selection == "all" and max_pairs is not None:
        raise ValueError(f"pair_selection='all' keeps every pair: max_pairs_per_task must be null, got {max_pairs}")
    values = rewards.double().tolist()
    pairs = [
        (win, lose)
        for win in range(len(values))
        for lose in range(len(values))
        if values[win] - values[lose] > 0 and _finite(values[win]) and _finite(values[lose])
    ]
    if selection == "reward_gap":
        pairs.sort(key=lambda p: values[p[0]] - values[p[1]], reverse=True)  # stable: ties keep (w, l) order
    elif selection == "random":
        order = torch.randperm(len(pairs), generator=generator).tolist()
        pairs = [pairs[i] for i in order]
    elif selection != "all":
        raise ValueError(f"pair_selection={selection!r}: choose reward_gap, random or all")
    return pairs if max_pairs is None else pairs[:max_pairs]


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")
