"""Exact expectations of the episode advantage estimators on a tiny tabular MDP.

Every group of G episodes is enumerated with its probability, so E[sum_e sum_t A[e,t] grad log
pi(a_t | s_t)] is computed exactly and compared with the true policy gradient (autograd through
J = sum over trajectories of P(tau) R(tau)). The MDP lets the policy decide when an episode ends and
revisits states, the two cases where a per-turn or per-state baseline can go wrong; the biased
estimators at the end (each a plausible implementation) must be caught. docs/credit.md has the
argument.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lit_marl.returns import (
    anchor_groups,
    episode_advantages,
    episode_group_advantages,
    returns_to_go,
    step_group_advantages,
)

# state -> action -> (next state or None: the episode ends, reward). Three states, two actions;
# A -> B -> A revisits A; "stop" ends the episode early; at most H turns.
MDP = {
    0: {0: (1, 0.0), 1: (None, 0.2)},  # A: go on to B, or stop with 0.2
    1: {0: (0, 0.1), 1: (2, 0.0)},  # B: back to A (a revisit), or on to C
    2: {0: (None, 1.0), 1: (1, 0.0)},  # C: finish with 1.0, or back to B
}
H = 3
G = 3


def trajectories():
    """Every trajectory from A: a list of (state, action, reward)."""
    out = []

    def extend(prefix, state):
        for action, (nxt, reward) in MDP[state].items():
            path = prefix + [(state, action, reward)]
            if nxt is None or len(path) == H:
                out.append(path)
            else:
                extend(path, nxt)

    extend([], 0)
    return out


TRAJ = trajectories()
THETA = torch.tensor([[0.3, -0.2], [-0.4, 0.5], [0.1, 0.2]], dtype=torch.float64)


def probability(theta, path):
    logp = torch.log_softmax(theta, dim=1)
    return torch.exp(sum(logp[s, a] for s, a, _ in path))


def true_gradient(sparse: bool):
    theta = THETA.clone().requires_grad_(True)
    J = sum(probability(theta, p) * total(p, sparse) for p in TRAJ)
    (grad,) = torch.autograd.grad(J, theta)
    return grad


def total(path, sparse: bool) -> float:
    return rewards_of(path, sparse).sum().item()


def rewards_of(path, sparse: bool) -> torch.Tensor:
    r = torch.tensor([reward for _, _, reward in path], dtype=torch.float64)
    if sparse:  # the whole return on the last turn
        r = torch.cat([torch.zeros(len(path) - 1, dtype=torch.float64), r.sum().view(1)])
    return r


def expectation(estimator, sparse: bool):
    """E over every group of G trajectories of (1/G) sum_e sum_t A[e, t] grad log pi(a_t | s_t)."""
    pi = torch.softmax(THETA, dim=1)
    probs = torch.stack([probability(THETA, p) for p in TRAJ])
    tuples = list(itertools.product(range(len(TRAJ)), repeat=G))
    rows = [TRAJ[i] for t in tuples for i in t]  # groups of G consecutive rows
    B = len(rows)
    rewards = torch.zeros(B, H)
    alive = torch.zeros(B, H, dtype=torch.bool)
    anchors = torch.full((B, H), -1, dtype=torch.long)
    score = torch.zeros(B, H, *THETA.shape, dtype=torch.float64)  # grad log pi of each step
    for b, path in enumerate(rows):
        rewards[b, : len(path)] = rewards_of(path, sparse).float()
        alive[b, : len(path)] = True
        for t, (s, a, _) in enumerate(path):
            anchors[b, t] = s
            score[b, t, s] = -pi[s]
            score[b, t, s, a] += 1.0
    adv = estimator(rewards, alive, anchors).double()
    per_row = (adv[:, :, None, None] * score).sum(dim=1)
    per_group = per_row.view(len(tuples), G, *THETA.shape).mean(dim=1)  # per episode
    weights = torch.stack([probs[list(t)].prod() for t in tuples])
    return (weights[:, None, None] * per_group).sum(dim=0)


def ours(mode, turn_level=False, step_weight=0.0, normalize=False):
    return lambda r, alive, anchors: episode_advantages(
        r, alive, G, mode, normalize, turn_level=turn_level, anchors=anchors, step_weight=step_weight
    )


def assert_matches(estimate, gradient, scale):
    assert torch.allclose(estimate, scale * gradient, rtol=1e-4, atol=1e-6), (estimate, scale * gradient)


def assert_biased(estimate, gradient):
    """Not any multiple of the true gradient: the direction itself is off. The residual of the best
    multiple, relative to the estimate, is sqrt(1 - cos^2); exact sums leave ~1e-6 of it."""
    cosine = torch.nn.functional.cosine_similarity(estimate.flatten(), gradient.flatten(), dim=0)
    residual = float((1 - cosine**2).clamp(min=0).sqrt())
    assert residual > 1e-3, residual


def test_unbiased_estimates_leave_no_residual():
    estimate, gradient = expectation(ours("rloo", turn_level=True), False), true_gradient(False)
    with pytest.raises(AssertionError):
        assert_biased(estimate, gradient)


def test_the_enumeration_exercises_grouped_and_singleton_steps():
    """The step-level rows below test grouping itself: steps group and singletons occur, and the
    step part differs from the singleton fallback it would be if nothing grouped."""
    seen = {}

    def spy(r, alive, anchors):
        seen["shared"] = anchor_groups(anchors, alive, G)
        seen["alive"] = alive
        seen["grouped"] = episode_advantages(r, alive, G, "rloo", False, anchors=anchors, step_weight=1.0)
        lonely = torch.arange(anchors.numel()).view(anchors.shape)
        seen["lonely"] = episode_advantages(r, alive, G, "rloo", False, anchors=lonely, step_weight=1.0)
        return seen["grouped"]

    expectation(spy, sparse=False)
    grouped = (seen["shared"] > 0) & seen["alive"]
    assert grouped.any() and (~grouped & seen["alive"]).any()
    assert not torch.allclose(seen["grouped"], seen["lonely"])
    assert (seen["shared"][:, 1:] > 0).any()  # later turns group too, not only the common start


def test_the_mdp_exercises_early_ends_and_revisits():
    lengths = {len(p) for p in TRAJ}
    assert lengths == {1, 3}  # the policy ends it at once or plays on
    assert any(len({s for s, _, _ in p}) < len(p) for p in TRAJ)  # a state visited twice
    assert torch.isclose(sum(probability(THETA, p) for p in TRAJ), torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize(
    "name, estimator, scale",
    [
        ("trajectory grpo", ours("grpo"), (G - 1) / G),
        ("trajectory rloo", ours("rloo"), 1.0),
        ("turn-level grpo", ours("grpo", turn_level=True), (G - 1) / G),
        ("turn-level rloo", ours("rloo", turn_level=True), 1.0),
        ("step-level rloo", ours("rloo", step_weight=1.0), 2.0),
        ("step-level grpo", ours("grpo", step_weight=0.5), (G - 1) / G + 0.5),
        ("step-level turn rloo", ours("rloo", turn_level=True, step_weight=2.0), 3.0),
    ],
)
def test_our_estimators_are_unbiased(name, estimator, scale, sparse):
    assert_matches(expectation(estimator, sparse), true_gradient(sparse), scale)


# --------------------------------------------------------------------------- what it catches
def alive_only(mode: str, turn_level: bool):
    """The per-turn-index baseline this project had before: the mean over the members still alive
    at t, its own return included (``grpo``: its share 1/n_t then varies with how many others still
    play), or the other live members' (``rloo``, no signal when alone at t)."""

    def estimator(r, alive, anchors):
        to_go = returns_to_go(r, alive)
        x = (to_go if turn_level else to_go[:, :1] * alive).view(-1, G, H)
        a = alive.float().view(-1, G, H)
        count, sums = a.sum(dim=1, keepdim=True), (x * a).sum(dim=1, keepdim=True)
        if mode == "grpo":
            return ((x - sums / count.clamp(min=1)) * a).view(-1, H)
        adv = (x - (sums - x * a) / (count - 1).clamp(min=1)) * a
        return torch.where(count > 1, adv, torch.zeros(())).view(-1, H)

    return estimator


def gigpo_own_steps(r, alive, anchors):
    """Step-level groups that pool every step from the anchor state, the episode's own (this step,
    and its earlier or later visits of the state) included, as a literal reading of GiGPO does."""
    to_go = returns_to_go(r, alive).view(-1, G * H)
    keys = anchors.view(-1, G * H)
    live = alive.view(-1, G * H)
    same = (keys[:, :, None] == keys[:, None, :]) & live[:, None, :] & live[:, :, None]
    mean = (same * to_go[:, None, :]).sum(-1) / same.sum(-1).clamp(min=1)
    return ((to_go - mean) * live).view(-1, H)


def singletons_get_nothing(r, alive, anchors):
    """GiGPO implementations' singleton rule: a step no other episode shares gets no step-level part,
    so a step's weight (1 or 1 + omega) depends on whether others happened to reach its state."""
    to_go = returns_to_go(r, alive)
    episode = episode_group_advantages(to_go[:, :1].expand_as(to_go), alive, G, "rloo", False)
    return episode + step_group_advantages(to_go, alive, anchors, G, torch.zeros_like(to_go), False)


def anchors_after_acting(r, alive, anchors):
    """Step-level groups keyed by the state the action LED to (a key recorded one turn late): the
    baseline then depends on the action it judges."""
    after = torch.cat([anchors[:, 1:], torch.full_like(anchors[:, :1], -1)], dim=1)
    after = torch.where(after >= 0, after, 100 + torch.arange(H).expand_as(after))  # the end: its own key per turn
    return episode_advantages(r, alive, G, "rloo", False, anchors=after, step_weight=1.0)


def own_reward_in_baseline(r, alive, anchors):
    """A baseline that peeks at the step's own reward (a function of the action it judges)."""
    return (returns_to_go(r, alive) - r) * alive


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize(
    "estimator",
    [
        alive_only("grpo", turn_level=False),
        alive_only("rloo", turn_level=False),
        alive_only("grpo", turn_level=True),
        alive_only("rloo", turn_level=True),
        gigpo_own_steps,
        singletons_get_nothing,
        anchors_after_acting,
        own_reward_in_baseline,
        ours("grpo", normalize=True),
        ours("grpo", turn_level=True, normalize=True),
        ours("rloo", step_weight=1.0, normalize=True),
    ],
    ids=[
        "old trajectory grpo (alive-only baseline)",
        "old trajectory rloo (alive-only, none when alone)",
        "old turn-level grpo",
        "old turn-level rloo",
        "anchor groups with own steps",
        "singletons get no step part",
        "anchors recorded after acting",
        "own reward in baseline",
        "std-normalized grpo",
        "std-normalized turn-level grpo",
        "std-normalized step-level",
    ],
)
def test_biased_estimators_are_caught(estimator, sparse):
    assert_biased(expectation(estimator, sparse), true_gradient(sparse))
