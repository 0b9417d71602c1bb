"""Pure functions for the math of returns and advantages. No models, no I/O."""

from __future__ import annotations

import functools
import itertools
from typing import Literal

import torch

AdvantageMode = Literal["mean", "raw", "max", "rloo"]
JointMode = Literal["aligned", "cross"]
CrossReduce = Literal["mean", "sum"]


NormalizationForm = Literal["rms", "zscore"]


def group_advantages(
    returns: torch.Tensor,
    mode: AdvantageMode = "mean",
    normalize: bool = False,
    std_floor: float = 1e-6,
    form: NormalizationForm = "rms",
) -> torch.Tensor:
    """Group-relative advantages; ``returns`` is ``[num_groups, G]`` (one group = one tree node).

    - ``mean``: r - mean(group) (MAGRPO / GRPO)
    - ``raw``: r itself, no baseline (MAREINFORCE)
    - ``max``: r - max(group) (MAReMax: only the best sample is not pushed down)
    - ``rloo``: r - mean(others), leave-one-out (MARLOO): equals G/(G-1) * (r - mean)

    ``normalize`` rescales each group's advantages, in one of two forms:

    - ``rms`` (default): divided by their root mean square, sqrt(sum A^2 / (G-1)), floored at
      ``std_floor`` - the spread of the returns around the baseline (for ``mean`` exactly the
      returns' sample std). No advantage exceeds sqrt(G-1) in size, whatever the returns: a tie
      gives 0 in the baselined modes and, in ``raw``, sign(r) * sqrt((G-1)/G), never 1/floor.
    - ``zscore`` (CoMLRL's): re-centred and divided by their population std floored at
      ``std_floor`` ((A - mean A) / std A). Re-centring removes
      any baseline, so every mode becomes ``mean``; a near-tie becomes a unit signal.

    A group of one response keeps its advantage in both forms.
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
    if not normalize or size < 2:  # one response: no spread to scale by (as CoMLRL: left as it is)
        return adv
    if form == "rms":
        rms = (adv.pow(2).sum(dim=1, keepdim=True) / max(size - 1, 1)).sqrt()
        return adv / rms.clamp(min=std_floor)
    if form == "zscore":
        centred = adv - adv.mean(dim=1, keepdim=True)
        return centred / adv.std(dim=1, keepdim=True, unbiased=False).clamp(min=std_floor)
    raise ValueError(f"advantage_normalization_form={form!r}: choose rms or zscore")


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


def joint_indices(num_agents: int, num_generations: int, joint_mode: JointMode) -> list[tuple[int, ...]]:
    """Response index of each agent for every joint action of one node."""
    if joint_mode == "aligned":
        return [(k,) * num_agents for k in range(num_generations)]
    if joint_mode == "cross":
        return list(itertools.product(range(num_generations), repeat=num_agents))
    raise ValueError(f"joint_mode={joint_mode!r}: choose aligned or cross")


def neutral_fill(rewards: torch.Tensor) -> torch.Tensor:
    """``[nodes, J, ...]`` rewards with NaN (skipped) entries replaced by the mean of their node's
    valid ones (0 if none), so a skipped sample gets no advantage and shifts no baseline."""
    valid = torch.isfinite(rewards)
    counts = valid.sum(dim=1, keepdim=True)
    means = torch.where(valid, rewards, 0.0).sum(dim=1, keepdim=True) / counts.clamp(min=1)
    return torch.where(valid, rewards, means.expand_as(rewards))


def per_response(
    values: torch.Tensor, joint_mode: JointMode, G: int, cross_reduce: CrossReduce = "mean"
) -> torch.Tensor:
    """``[nodes, J, agents]`` values of joint actions -> ``[agents, nodes, G]`` values of each
    agent's responses: in ``aligned`` mode joint action k is response k; in ``cross`` mode a
    response gets the mean over the joint actions that contain it (``cross_reduce: sum``:
    CoMLRL's sum, G^(N-1) times the mean)."""
    if joint_mode == "aligned":
        return values.permute(2, 0, 1)
    num_agents = values.shape[2]
    out = torch.stack(
        [
            torch.stack([cross_agent_returns(v[:, i].reshape((G,) * num_agents))[i] for v in values])
            for i in range(num_agents)
        ]
    )
    if cross_reduce == "sum":
        return out * G ** (num_agents - 1)
    if cross_reduce != "mean":
        raise ValueError(f"cross_return={cross_reduce!r}: choose mean or sum")
    return out


# --------------------------------------------------------------------------- multi-turn episodes
def step_reward(
    previous_score: float,
    score: float,
    max_score: float,
    won: bool,
    ends: bool,
    density: Literal["sparse", "dense"] = "sparse",
    score_weight: float | None = None,
) -> float:
    """One turn's reward from a game's outcome (``envs.game.RewardRule``, the one place the rule
    lives): ``score`` is the cumulative score after the turn, ``previous_score`` before it, ``ends``:
    the episode ended on it.

    - ``sparse``: the outcome on the turn that ends the episode: ``won`` (1 or 0) + ``score_weight``
      x score / max_score (default 0: the pure outcome); 0 before;
    - ``dense``: the turn's score delta x ``score_weight`` / max_score (default 0.5), plus ``won``.

    With ``score_weight < 1`` a lost episode totals at most ``score_weight`` < 1 <= a won one's total:
    milestones never outscore success. Computed in float32, as the rewards are stored.
    """
    if score_weight is None:
        score_weight = 0.0 if density == "sparse" else 0.5
    if not 0 <= score_weight < 1:
        raise ValueError(f"score_weight={score_weight}: must be in [0, 1) so that no lost episode outscores a won one")
    as32 = functools.partial(torch.tensor, dtype=torch.float32)
    scale = score_weight / as32(max_score).clamp(min=1e-8)
    if density == "sparse":
        return float(as32(float(won)) + as32(score) * scale) if ends else 0.0
    if density == "dense":
        return float((as32(score) - as32(previous_score)) * scale + float(won))
    raise ValueError(f"reward_density={density!r}: choose sparse or dense")


def token_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the agent's own tokens (``mask`` 1), ``[B, L]`` each; observation and padding tokens
    (``mask`` 0) are skipped: the next value and the running GAE are carried across them, so the
    agent's tokens form one chain. Rewards sit on action tokens (e.g. each turn's end token).
    Returns (advantages, returns = advantages + values), zero where ``mask`` is 0."""
    B, L = rewards.shape
    advantages = torch.zeros(B, L, dtype=torch.float32)
    next_value = torch.zeros(B)
    running = torch.zeros(B)
    for t in range(L - 1, -1, -1):
        m = mask[:, t].bool()
        delta = rewards[:, t].float() + gamma * next_value - values[:, t].float()
        new_running = delta + gamma * lam * running
        advantages[:, t] = torch.where(m, new_running, torch.zeros(()))
        running = torch.where(m, new_running, running)
        next_value = torch.where(m, values[:, t].float(), next_value)
    returns = torch.where(mask.bool(), advantages + values.float(), torch.zeros(()))
    return advantages, returns


def turn_gae(
    rewards: torch.Tensor, values: torch.Tensor, alive: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with one value per turn, ``[B, T]`` each (``alive`` 0 after an episode's end): turn
    advantages, broadcast to each turn's tokens by the caller. Returns (advantages, returns)."""
    return token_gae(rewards, values, alive, gamma, lam)


def returns_to_go(rewards: torch.Tensor, alive: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return from each turn on, ``[B, T]`` (0 where not ``alive``)."""
    out = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = torch.where(alive[:, t].bool(), rewards[:, t].float() + gamma * running, running)
        out[:, t] = torch.where(alive[:, t].bool(), running, torch.zeros(()))
    return out


def episode_group_advantages(
    returns: torch.Tensor, alive: torch.Tensor, group_size: int, mode: Literal["grpo", "rloo"], normalize: bool
) -> torch.Tensor:
    """Per-turn advantages of G episodes per task (consecutive rows), ``[B, T]`` (0 where not ``alive``).

    ``returns[e, t]`` is what episode e's turn t is credited with: its episode return on every turn
    (trajectory level; also after the episode's end) or its return-to-go (turn level; 0 after the
    end: a finished episode sits in an absorbing state that pays nothing). The baseline at turn t is
    the mean over ALL G members of the group (``grpo``, its own included) or over the other G-1
    (``rloo``, leave-one-out), never over the members still alive at t only: which of the others
    are alive does not depend on e, but how many share the mean with e's own return would, and the
    share of e's own return in its baseline, 1/n_t, would then weight each turn's gradient by
    1 - 1/n_t - a reweighting of the turns that is not the policy gradient (docs/credit.md works
    it out; ``tests/unit/test_credit_exact.py`` measures it). So: ``rloo`` is unbiased,
    ``grpo`` is (G-1)/G times the policy gradient. ``normalize`` divides by the group's sample std at
    that turn (GRPO's scaling, ``group_spread``; it depends on e's own return, so it is biased, as in GRPO), a tie up to
    rounding giving 0 (``divide_by_spread``)."""
    B, T = returns.shape
    if B % group_size:
        raise ValueError(f"{B} episodes do not split into groups of {group_size}")
    r = returns.double().view(-1, group_size, T)  # float64: a tie stays a tie
    total = r.sum(dim=1, keepdim=True)
    if mode == "grpo":
        adv = r - total / group_size
    elif mode == "rloo":
        adv = r - (total - r) / (group_size - 1) if group_size > 1 else torch.zeros_like(r)
    else:
        raise ValueError(f"mode={mode!r}: choose grpo or rloo")
    if normalize:
        adv = divide_by_spread(adv, group_spread(returns, group_size).view(-1, group_size, T), r)
    return (adv.view(B, T) * alive.double()).float()


def group_spread(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B, T]``: the sample std (divided by G - 1, as ``torch.std``, veRL's and TRL's GRPO and
    ``group_advantages``' ``rms`` form) over each task's G members (consecutive rows) at each turn,
    computed in float64 around the mean (two passes); 0 for a group of one."""
    B, T = values.shape
    v = values.double().view(-1, group_size, T)
    centred = v - v.mean(dim=1, keepdim=True)
    variance = centred.pow(2).sum(dim=1, keepdim=True) / max(group_size - 1, 1)
    return variance.sqrt().expand_as(v).reshape(B, T)


def divide_by_spread(adv: torch.Tensor, spread: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``adv / spread``, each ``[groups, G, T]`` like ``values``, and 0 where the spread is no more
    than the rounding noise of its group's ``values`` (1e-6 of their largest size in that group, over
    its members and turns): returns that tie up to rounding carry no signal, where dividing their
    rounding differences by a near-zero spread would make one up. The noise is each group's own: a
    group of large returns elsewhere in the batch does not swallow a small group's real spread."""
    if not values.numel():
        return adv
    noise = 1e-6 * (1.0 + values.abs().flatten(1).amax(1)).view(-1, 1, 1)
    return torch.where(spread > noise, adv / torch.maximum(spread, noise), torch.zeros((), dtype=adv.dtype))


def _shared_anchors(anchors: torch.Tensor, alive: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[groups, e, j, t, t']``: episode j != e of the same task acted at turn t' from the state
    episode e acted from at turn t (both turns played)."""
    B, T = anchors.shape
    if B % group_size:
        raise ValueError(f"{B} episodes do not split into groups of {group_size}")
    G, live = group_size, alive.bool()
    same = anchors.view(-1, G, 1, T, 1) == anchors.view(-1, 1, G, 1, T)
    same = same & live.view(-1, 1, G, 1, T) & live.view(-1, G, 1, T, 1)
    return same & ~torch.eye(G, dtype=torch.bool).view(1, G, G, 1, 1)


def anchor_groups(anchors: torch.Tensor, alive: torch.Tensor, group_size: int) -> torch.Tensor:
    """How many steps of the OTHER episodes of its task share each step's anchor state, ``[B, T]``
    (0 where not ``alive``). ``anchors[e, t]`` is an id of the state episode e acted from at turn t
    (equal ids: the same state; ids are compared within a task's group of G consecutive rows only).
    A step with 0 is a singleton: no other episode reached its state."""
    return _shared_anchors(anchors, alive, group_size).sum(dim=(2, 4)).view(anchors.shape)


def step_group_advantages(
    to_go: torch.Tensor,
    alive: torch.Tensor,
    anchors: torch.Tensor,
    group_size: int,
    fallback: torch.Tensor,
    normalize: bool,
) -> torch.Tensor:
    """The step-level part of GiGPO's advantage over anchor states, ``[B, T]`` (0 where not ``alive``).

    Episode e's step t from anchor state s is credited with its return-to-go ``to_go[e, t]`` against
    the mean return-to-go of the steps of the OTHER episodes of its task that acted from s (at any
    turn; each such step counts once). Its own episode's steps never enter its baseline (a later
    visit of s depends on the action being judged, an earlier one's return contains it), and
    neither does its own return: that keeps the baseline a function of e's history and of
    independent episodes, so the estimate is unbiased (docs/credit.md). A singleton step (no other
    episode reached s) takes ``fallback[e, t]`` instead, the episode-level leave-one-out advantage,
    so each step still counts once. ``normalize`` divides a grouped step by the std of its group's
    returns, its own included (GiGPO's scaling; biased, like GRPO's)."""
    B, T = to_go.shape
    G = group_size
    same = _shared_anchors(anchors, alive, G).double()
    r = to_go.double().view(-1, G, T)
    other = to_go.double().view(-1, 1, G, 1, T)
    count = same.sum(dim=(2, 4))
    total = (same * other).sum(dim=(2, 4))
    adv = r - total / count.clamp(min=1)
    if normalize:  # the sample std of the group (the other steps and this one, n - 1 = count), around its mean
        mean = (total + r) / (count + 1)
        square = (same * (other - mean.view(-1, G, 1, T, 1)) ** 2).sum(dim=(2, 4)) + (r - mean) ** 2
        adv = divide_by_spread(adv, (square / count.clamp(min=1)).sqrt(), r)
    adv = torch.where(count > 0, adv, fallback.double().view(-1, G, T))
    return (adv.view(B, T) * alive.double()).float()


def episode_advantages(
    rewards: torch.Tensor,
    alive: torch.Tensor,
    group_size: int,
    mode: Literal["grpo", "rloo"],
    normalize: bool,
    turn_level: bool = False,
    anchors: torch.Tensor | None = None,
    step_weight: float = 0.0,
    discount: float = 1.0,
) -> torch.Tensor:
    """GRPO's and RLOO's per-turn advantages of G episodes per task, ``[B, T]``, from each turn's
    reward ``[B, T]``: the episode level (the episode's return, or with ``turn_level`` each turn's
    return-to-go, against the group: ``episode_group_advantages``) plus ``step_weight`` times the
    step level over ``anchors`` (``step_group_advantages``, singletons taking the episode's
    leave-one-out advantage). Unnormalized, the expectation is c times the policy gradient:
    c = (G-1)/G (``grpo``) or 1 (``rloo``), plus ``step_weight`` (docs/credit.md). ``normalize``
    divides the episode level by the spread of the group's episode returns (at the turn level too:
    per turn, a late turn's lone survivor would get +-sqrt(G-1) for any return-to-go, however small)
    and the step level by its anchor group's spread."""
    to_go = returns_to_go(rewards, alive, discount)
    episode = to_go[:, :1].expand_as(to_go)  # the episode's return, credited to every turn
    if turn_level:  # scaled by the spread of the episode returns: a late turn's few survivors are not blown up
        adv = episode_group_advantages(to_go, alive, group_size, mode, False)
        if normalize:
            grouped = (-1, group_size, episode.shape[1])
            spread = group_spread(episode, group_size).view(grouped)
            adv = divide_by_spread(adv.view(grouped), spread, episode.view(grouped)).reshape(adv.shape).float()
    else:
        adv = episode_group_advantages(episode, alive, group_size, mode, normalize)
    if step_weight > 0:
        if anchors is None:
            raise ValueError("step_weight > 0 needs the anchors of the steps")
        fallback = episode_group_advantages(episode, alive, group_size, "rloo", normalize)
        adv = adv + step_weight * step_group_advantages(to_go, alive, anchors, group_size, fallback, normalize)
    return adv


# --------------------------------------------------------------------------- actor-critic (one trajectory per episode)
def team_reward(per_agent_rewards: list[torch.Tensor]) -> torch.Tensor:
    """The joint reward of each row: the mean of the agents' rewards (MAAC's critic learns it)."""
    return torch.stack(per_agent_rewards).mean(0)


def next_turn_rows(group_ids: torch.Tensor, next_group: torch.Tensor) -> torch.Tensor:
    """Per row (one node's response, a node holding one row): the row of the node its joint action
    led to, -1 where none (the episode's last turn)."""
    counts = torch.bincount(group_ids)
    if (next_group >= 0).any() and (counts > 1).any():
        raise ValueError("TD targets follow one trajectory: a multi-turn rollout needs data.num_generations=1")
    row_of = torch.zeros(len(counts), dtype=torch.long, device=group_ids.device)
    row_of[group_ids] = torch.arange(len(group_ids), device=group_ids.device)
    return torch.where(next_group >= 0, row_of[next_group.clamp(min=0)], -1)


def td_targets(
    rewards: torch.Tensor, values: torch.Tensor, next_rows: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """One-step TD targets, one per row (a turn of one episode): y = r + gamma * V(h_next) where
    ``next_rows`` points at the row of the episode's next turn, y = r at its last turn (the final or
    an early-terminated one, ``next_rows = -1``: no bootstrap after it). ``values[row]`` is V(h) of
    that row's state."""
    following = values.float()[next_rows.clamp(min=0)]
    return rewards.float() + gamma * torch.where(next_rows >= 0, following, torch.zeros(()))


def td_advantages(targets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A = y - V(h) per row (z-scored per turn over every rank by ``parallel.collectives.z_score_per_group``)."""
    return targets.float() - values.float()
