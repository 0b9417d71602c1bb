"""Pure loss terms, named like the papers; one formula each. No models, no I/O.

Per-token terms take ``[B, C]`` tensors (log-probs of the tokens a policy produced) and return
``[B, C]``; the algorithm masks and reduces them (``masked_sum``), so each term is written once
whatever the algorithm's reduction.
"""

from __future__ import annotations

from typing import Literal

import torch

Reduction = Literal["sum", "mean"]


def masked_sum(per_token: torch.Tensor, mask: torch.Tensor, reduction: Reduction = "sum") -> torch.Tensor:
    """``[B, C]`` -> ``[B]``: the sum over each row's masked tokens, or with ``mean`` their mean
    (a row without tokens gives 0)."""
    mask = mask.float()
    per_row = (per_token * mask).sum(-1)
    if reduction == "mean":
        per_row = per_row / mask.sum(-1).clamp(min=1)
    return per_row


def reinforce(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE (Williams 1992): -A * log pi(a), the ratio-free policy gradient's surrogate."""
    return -logprobs * advantages


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al. 2017), as a loss: -min(rho A, clip(rho, 1 +- eps) A)
    with rho = pi / pi_old, per token. ``dual_clip`` c > 1 (dual-clip PPO, Ye et al. 2020; veRL's
    ``clip_ratio_c``): where A < 0 the loss is at most -c A, so a token whose ratio has grown past c
    while its advantage is negative stops pushing (its gradient is 0 there).

    rho = exp of the log-ratio held in +-20 (``LOG_RATIO_BOUND``), as veRL's ``compute_policy_loss``
    clamps ``negative_approx_kl``: past about 88.7 float32's exp is inf, and an inf ratio makes the
    loss inf or its gradient NaN (inf x 0) even where clipping takes the other term. Inside +-20 rho
    is exp's, bit for bit; beyond, rho is e^+-20 with no gradient (a token there is clipped anyway,
    or with A < 0 and no ``dual_clip`` it adds a large constant)."""
    ratio = bounded_exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


LOG_RATIO_BOUND = 20.0
"""A log-ratio is held in +-20 before exp (veRL's policy loss and ``low_var_kl``/``k3``), so exp never overflows."""


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of ``log_ratio`` held in +-``LOG_RATIO_BOUND``: exp's value inside, e^+-20 and no gradient beyond."""
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def k3_kl(log_ratio: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from samples of p: exp(d) - d - 1 with
    d = log q - log p (non-negative, unbiased). For the KL to a reference, d = log p_ref - log pi;
    for PPO's approximate KL to the behaviour policy (samples of the old policy), d = log pi - log pi_old.
    d is first held in +-20 (``LOG_RATIO_BOUND``), as veRL's ``k3``/``low_var_kl`` does: past about
    88.7 float32's exp is inf (an inf estimate, a NaN gradient); inside +-20 the estimate is exact, a
    token beyond adds k3(+-20) and no gradient. ``clamp`` (veRL's ``low_var_kl`` uses 10): the estimate
    capped at ``clamp`` too - a token far from the reference then adds at most ``clamp`` and no
    gradient (biased, bounded)."""
    d = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    kl = d.exp() - d - 1
    return kl if clamp is None else kl.clamp(max=clamp)


def clip_fraction(log_ratio: torch.Tensor, clip_range: float) -> torch.Tensor:
    """1 where the ratio pi / pi_old is outside 1 +- eps (the tokens PPO's clipping acts on), else 0."""
    return ((log_ratio.exp() - 1).abs() > clip_range).float()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Mean (or ``sum``) over ``mask`` of (y - V)^2, or with ``clip_range`` the larger of it and
    (y - V_clip)^2 where V_clip = V_old + clip(V - V_old, +-clip_range) (PPO2's value clipping)."""
    error = (values.float() - targets.float()) ** 2
    if clip_range is not None:
        clipped = old_values.float() + (values.float() - old_values.float()).clamp(-clip_range, clip_range)
        error = torch.maximum(error, (clipped - targets.float()) ** 2)
    mask = mask.float()
    total = (error * mask).sum()
    return total if reduction == "sum" else total / mask.sum().clamp(min=1)


def nll(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens, summed (supervised fine-tuning)."""
    return -(logprobs * mask).sum()


def explained_variance(targets: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """1 - Var(y - V) / Var(y) over the given entries (population variances): 1 is a perfect
    critic, 0 one no better than a constant, below 0 worse; Var(y) is floored at 1e-8."""
    targets, values = targets.float(), values.float()
    return 1 - (targets - values).var(unbiased=False) / targets.var(unbiased=False).clamp(min=1e-8)


def joint_dpo(deltas: torch.Tensor, agent: int, beta: float) -> torch.Tensor:
    """Joint-factorised DPO (MADPO) of ``agent`` per pair: -log sigmoid(beta * (D_i + sum_{j != i} sg(D_j))).

    ``deltas`` is ``[agents, pairs]``: D_j = log pi_j(y_w) - log pi_j(y_l) for agent j's parts of the
    chosen and the rejected joint answer (the reference-anchored form subtracts the reference's
    difference first). The joint answer's log-likelihood is the sum over agents (they act
    independently), so this is DPO (Rafailov et al. 2023) on the joint policy; the other agents'
    terms are constants (stop-gradient) so each agent gets gradient through its own D_i only."""
    others = deltas.detach().sum(0) - deltas[agent].detach()
    return -torch.nn.functional.logsigmoid(beta * (deltas[agent] + others))


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry (1952) negative log-likelihood that ``chosen`` beats ``rejected``, per pair:
    -log sigmoid(r_w - r_l) for scalar rewards r (a reward model's scores)."""
    return -torch.nn.functional.logsigmoid(chosen - rejected)


def truncated_is_weights(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling against the rollout engine (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; veRL's TIS, TRL's
    ``vllm_importance_sampling_correction``): per token min(pi / pi_rollout, cap), no gradient. The
    engine sampled from pi_rollout (other kernels, another precision, a stale cache), the loss is
    written for the trainer's pi; the weight corrects the expectation and the cap bounds its variance."""
    return (logprobs - rollout_logprobs).detach().exp().clamp(max=cap)
