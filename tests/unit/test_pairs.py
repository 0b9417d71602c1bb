"""Preference pair selection (``lit_marl/rollout/pairs.py``) on hand-built rewards."""

from __future__ import annotations

import pytest
import torch

from lit_marl.rollout.pairs import select_pairs

T = torch.tensor


def test_every_ordered_pair_with_a_positive_gap_ties_dropped():
    # candidates 0 and 2 tie: no pair between them
    pairs = select_pairs(T([0.5, 1.0, 0.5, 0.0]), "all", max_pairs=None)
    assert pairs == [(0, 3), (1, 0), (1, 2), (1, 3), (2, 3)]


def test_reward_gap_takes_the_largest_gaps_first_and_caps():
    rewards = T([0.5, 1.0, 0.5, 0.0])
    # gaps: (1,3)=1.0, then 0.5: (0,3), (1,0), (1,2), (2,3) in (w, l) order
    assert select_pairs(rewards, "reward_gap", max_pairs=None) == [(1, 3), (0, 3), (1, 0), (1, 2), (2, 3)]
    assert select_pairs(rewards, "reward_gap", max_pairs=2) == [(1, 3), (0, 3)]


def test_all_equal_rewards_give_no_pair():
    for selection, cap in (("reward_gap", 16), ("random", 16), ("all", None)):
        assert select_pairs(T([0.3, 0.3, 0.3]), selection, cap) == []


def test_random_is_a_seeded_subset_of_the_valid_pairs():
    rewards = T([0.0, 0.25, 0.5, 0.75, 1.0])
    every = set(select_pairs(rewards, "all", None))
    draws = [select_pairs(rewards, "random", 4, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(len(d) == 4 and set(d) <= every and len(set(d)) == 4 for d in draws)
    assert select_pairs(rewards, "random", 4, torch.Generator().manual_seed(3)) == draws[3]  # same seed, same pairs
    assert len({tuple(d) for d in draws}) > 1  # not a fixed choice


def test_non_finite_rewards_never_pair():
    pairs = select_pairs(T([float("nan"), 1.0, 0.0, float("inf")]), "all", None)
    assert pairs == [(1, 2)]


def test_all_with_a_cap_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"max_pairs must be None \(model.pairs.per_task: null\)"):
        select_pairs(T([1.0, 0.0]), "all", 4)
