"""Pure functions for the math of returns and advantages. No models, no I/O."""

from __future__ import annotations

from typing import Literal

import torch

AdvantageMode = Literal["mean", "raw", "max", "rloo"]


def group_advantages(
    returns: torch.Tensor, mode: AdvantageMode = "mean", normalize: bool = False, std_floor: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages; ``returns`` is ``[num_groups, G]`` (one group = one tree node).

    - ``mean``: r - mean(group) (MAGRPO / GRPO)
    - ``raw``: r itself, no baseline (MAREINFORCE)
    - ``max``: r - max(group) (MAReMax: only the best sample is not pushed down)
    - ``rloo``: r - mean(others), leave-one-out (MARLOO): equals G/(G-1) * (r - mean)
    ``normalize`` divides by the group's standard deviation, floored at ``std_floor`` so that
    groups with (nearly) equal returns keep small advantages instead of blowing up.
    """
    if returns.dim() != 2:
        raise ValueError(f"returns must be [num_groups, G], got shape {tuple(returns.shape)}")
    size = returns.shape[1]
    if mode == "mean":
        adv = returns - returns.mean(dim=1, keepdim=True)
    elif mode == "raw":
        adv = returns.clone()
    elif mode == "max":
        adv = returns - returns.max(dim=1, keepdim=True).values
    elif mode == "rloo":
        if size < 2:
            raise ValueError("advantage_mode='rloo' needs groups of at least 2")
        adv = returns - (returns.sum(dim=1, keepdim=True) - returns) / (size - 1)
    else:
        raise ValueError(f"advantage_mode={mode!r}: choose one of mean, raw, max, rloo")
    if normalize:
        adv = adv / returns.std(dim=1, keepdim=True, unbiased=size > 1).clamp(min=std_floor)
    return adv


def cross_agent_returns(joint_returns: torch.Tensor) -> torch.Tensor:
    """Per-agent returns of each sampled response in a cross (Cartesian) joint mode.

    ``joint_returns`` has one axis per agent, each of size G: entry ``[k0, k1, ...]`` is the return
    of the joint action in which agent i took its response ``k_i``. An agent's return for its
    response k is the mean over all joint actions that contain k. Returns ``[num_agents, G]``.
    """
    num_agents = joint_returns.dim()
    if num_agents == 1:
        return joint_returns.unsqueeze(0)
    return torch.stack(
        [joint_returns.mean(dim=tuple(d for d in range(num_agents) if d != agent)) for agent in range(num_agents)]
    )


def tree_returns(
    rewards: list[torch.Tensor], children: list[torch.Tensor], discount: float = 1.0
) -> list[torch.Tensor]:
    """Returns of every joint action of a rollout tree, level by level (level t = turn t).

    ``rewards[t]`` is ``[nodes_t, J]`` (or ``[nodes_t, J, num_agents]`` for per-agent rewards): the
    immediate reward of each of a node's J joint actions.
    ``children[t]`` is ``[nodes_t, J]``: the index in level t+1 of the child node that joint action
    led to, or -1 if it has none (last turn, or the node terminated early).
    R = r for a joint action without a child; otherwise R = r + discount * mean(R of the child's
    joint actions).
    """
    if len(rewards) != len(children):
        raise ValueError("rewards and children need one entry per level")
    returns: list[torch.Tensor] = [torch.empty(0)] * len(rewards)
    below: torch.Tensor | None = None  # mean return of each node of the next level
    for level in reversed(range(len(rewards))):
        r, child = rewards[level], children[level]
        if below is None:
            if (child >= 0).any():
                raise ValueError(f"level {level} points to children but there is no level below it")
            returns[level] = r.clone()
        else:
            has_child = (child >= 0).view(*child.shape, *([1] * (r.dim() - 2)))  # per-agent rewards: [.., N]
            bootstrap = torch.where(has_child, below[child.clamp(min=0)], torch.zeros_like(r))
            returns[level] = r + discount * bootstrap
        below = returns[level].mean(dim=1)
    return returns
