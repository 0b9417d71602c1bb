"""The settings groups of the RL families, each declared once and passed whole from YAML to the
family that reads it: ``model.update`` (how rollouts become optimizer steps), ``model.advantage``
(how returns become advantages), ``model.kl`` (a KL term to the reference), ``model.buffer`` (when
a buffered family updates, and in which order), ``model.critic`` (an actor-critic family's value
function), ``model.memory`` (what a team's passes and stored weights hold: every family). A family
reads only some fields of a group (``Family.update_fields``); a field it does not read, set away
from its default, stops the run naming the family (``check_unread``), so no setting is ever
silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from lit_marl import ConfigError
from lit_marl.fields import (
    AboveOne,
    ClosedUnitInterval,
    NonNegativeFloat,
    NonNegativeInt,
    OpenUnitInterval,
    PositiveFloat,
    PositiveInt,
    as_group,
    check_dataclass,
    saved_groups,
)
from lit_marl.losses import Reduction
from lit_marl.models import WeightsDtype
from lit_marl.returns import AdvantageMode, NormalizationForm
from lit_marl.rollout.buffer import UpdateSchedule


@dataclass(frozen=True)
class UpdateSettings:
    """How a batch of rollouts becomes optimizer steps (``model.update``): MAGRPO, IAC/MAAC and the
    episode algorithms (PPO, GRPO, RLOO) read the fields their loss has."""

    ppo_epochs: PositiveInt = 1
    """Passes over each update's samples, the behaviour log-probs staying the rollout's (veRL's
    ``ppo_epochs``; IAC/MAAC: with ``model.policy_loss: ppo`` only, the ratio-free loss being on-policy)."""
    train_batch_size: PositiveInt | None = None
    """Groups per mini-batch, one optimizer step each - a group is the samples that share a baseline: a tree
    node's G responses (MAGRPO), one turn of one episode (IAC/MAAC), a task's G episodes (PPO, GRPO, RLOO);
    None: the whole update in one step per pass."""
    clip_range: OpenUnitInterval = 0.2
    """PPO's ratio clipping epsilon (the episode algorithms; IAC/MAAC with ``policy_loss: ppo``)."""
    dual_clip: AboveOne | None = None
    """Dual-clip PPO's c (veRL's ``clip_ratio_c``, the guide's 3): a token with a negative advantage loses at
    most c times it, however far its ratio grew; None: off (Schulman, TRL). The episode algorithms."""
    target_kl: PositiveFloat | None = None
    """Stop an update's remaining epochs once an epoch's mean approximate KL to the behaviour policy (on each
    mini-batch's forward, before its step, as cleanrl) exceeds this; None: never. IAC/MAAC with ``ppo``."""
    entropy_coef: NonNegativeFloat = 0.0
    """Weight of the entropy bonus on the response tokens (0: none). IAC/MAAC."""
    logprob_reduction: Reduction = "sum"
    """A response's loss is the ``sum`` of its tokens' terms (the sequence log-likelihood: CoMLRL's) or their
    ``mean`` (length-normalized). MAGRPO, IAC/MAAC; the episode algorithms sum over the agent's tokens."""
    rollout_is_cap: PositiveFloat | None = None
    """Truncated importance sampling against the rollout engine's log-probs (veRL's TIS, TRL's
    ``vllm_importance_sampling_cap``): each token's term weighted by min(pi / pi_rollout, cap); None: off
    (the mismatch is logged either way: docs/generation.md)."""
    skip_signalless_steps: bool = False
    """GRPO/RLOO: an optimizer step whose rows all have zero advantage on every rank (every group tied) is
    not taken, weights and AdamW state untouched (taken, AdamW's momentum repeats the last informative step's
    direction); ``train/skipped_steps`` counts them. Not with a critic or a KL term."""
    sft_coef: NonNegativeFloat = 0.0
    """The episode algorithms: each optimizer step of RL also learns a batch of the demonstrations
    (``data.demos``: its ``path``, ``batch_size`` rows a step and rank, ``loss_on``), this weight times
    their mean negative log-likelihood per token (at temperature 1, as the SFT phase) added to the step's
    loss (InstructGPT's PPO-ptx, OpenRLHF's ``ptx_coef``): RL after SFT kept near what SFT taught. 0: off."""
    tempered_logprobs: bool = False
    """Score every log-prob of the update (the policy's, the behaviour's, a KL reference's, the entropy) under
    the sampling distribution, the logits divided by ``data.sampling.temperature``: veRL's, TRL's and
    OpenRLHF's math. False: under the untempered policy (CoMLRL's); the two agree at temperature 1. The
    engines report untempered log-probs, so with it the rollout mismatch is not measured and
    ``rollout_is_cap`` is refused."""

    def __post_init__(self):
        check_dataclass("model.update", self)
        if self.tempered_logprobs and self.rollout_is_cap is not None:
            raise ConfigError(
                "model.update.tempered_logprobs with model.update.rollout_is_cap: the engines report untempered "
                "log-probs, so their ratio to tempered ones is no importance weight; drop one of the two"
            )


@dataclass(frozen=True)
class AdvantageSettings:
    """How returns become advantages (``model.advantage``): each family reads the fields of its
    estimator (``Family.advantage_fields``); docs/credit.md compares them."""

    normalization: bool | None = None
    """Rescale the advantages: MAGRPO each tree node's (``normalization_form``), GRPO/RLOO each task's
    group by its sample std (veRL's and TRL's; also the step-level part's, by its anchor group's), PPO
    whitened over the step's action tokens, IAC/MAAC z-scored per (agent, turn) group. None: on, but
    off for RLOO, whose leave-one-out baseline is the unbiased estimator only unscaled."""
    mode: AdvantageMode = "mean"
    """MAGRPO's baseline within each node's G siblings: ``mean`` (MAGRPO), ``raw`` (MAREINFORCE),
    ``max`` (MAReMax) or ``rloo`` (MARLOO, leave-one-out); the named variants set it themselves."""
    normalization_form: NormalizationForm = "rms"
    """MAGRPO: ``rms`` divides each node's advantages by their root mean square (for ``mean`` the
    returns' sample std; no advantage exceeds sqrt(G-1), a tie never becomes a large signal);
    ``zscore``: CoMLRL's re-centring and division by the population std (every mode becomes ``mean``;
    a near-tie becomes a unit signal). See ``returns.group_advantages``."""
    std_floor: PositiveFloat = 1e-3
    """MAGRPO: lower bound of the normalization's divisor (CoMLRL's: 1e-6)."""
    turn_level: bool = False
    """GRPO/RLOO: each turn's advantage from its return-to-go, baselined across the group at that turn
    (a finished episode counting 0; for dense rewards); otherwise the episode's return for every turn."""
    step_weight: NonNegativeFloat = 0.0
    """GRPO/RLOO: GiGPO's omega: add this times the step-level advantage - the step's return-to-go
    against the other episodes' steps from the same anchor state (``data.anchor``) - to the
    episode-level one; a step no other episode shares keeps the episode-level part only (0: off)."""
    gae: Literal["token", "turn"] = "token"
    """PPO: ``token``: GAE over the agent's tokens; ``turn``: one value and advantage per turn."""
    gae_lambda: ClosedUnitInterval = 0.95
    """PPO: GAE's lambda (veRL's ``lam``; 1: Monte Carlo returns against the critic's values)."""

    def __post_init__(self):
        check_dataclass("model.advantage", self)

    def normalized(self, default: bool = True) -> bool:
        """Whether to rescale: ``normalization``, or the family's ``default`` when it is None."""
        return default if self.normalization is None else self.normalization


@dataclass(frozen=True)
class KLSettings:
    """A KL(policy || reference) term (``model.kl``), the reference named by ``model.kl_reference``:
    MAGRPO reads ``coef`` (always a reward penalty: each response's summed k3 estimate subtracted
    from its agent's reward before returns); the episode algorithms read every field."""

    coef: NonNegativeFloat = 0.0
    """Weight of the term; 0: none (no reference is built)."""
    mode: Literal["loss", "reward"] = "loss"
    """The episode algorithms: ``loss``, a loss term (k3 per token, veRL's ``use_kl_loss``); ``reward``, k1
    subtracted from each token's reward (veRL's ``use_kl_in_reward``)."""
    clamp: PositiveFloat | None = None
    """With ``mode: loss``, cap each token's k3 at this (its log-ratio at +-20), as veRL's ``low_var_kl``
    does with 10; None: not capped (k3 itself, its log-ratio still held at +-20)."""

    def __post_init__(self):
        check_dataclass("model.kl", self)
        if self.clamp is not None and (self.mode != "loss" or self.coef == 0):
            raise ConfigError(
                f"model.kl.clamp={self.clamp} caps the KL loss term: it needs model.kl.mode: loss and "
                f"model.kl.coef > 0 (got mode: {self.mode}, coef: {self.coef}); remove clamp otherwise"
            )


@dataclass(frozen=True)
class BufferSettings:
    """When a buffered family (MAGRPO, IAC/MAAC) updates and in which order (``model.buffer``)."""

    size: PositiveInt | None = None
    """An update fires when each agent's buffer holds this many groups (MAGRPO: tree nodes; IAC/MAAC: one
    per turn of an episode); None: after every training step. What is left at an epoch's end is used then."""
    schedule: UpdateSchedule = "joint"
    """``joint``: mini-batches of every turn, shuffled; ``per_turn``: CoMLRL's order, each turn its own steps
    in turn order (``model.update.train_batch_size: null``: one per turn)."""

    def __post_init__(self):
        check_dataclass("model.buffer", self)


@dataclass(frozen=True)
class CriticSettings:
    """The value function of an actor-critic family (``model.critic``): IAC, MAAC, PPO."""

    kind: Literal["head", "model"] | None = None
    """``head``: a value head on each actor's last hidden state (trained with the actor's loss,
    ``learning_rate`` on its own parameters); ``model``: a separate critic model with its own optimizer.
    None: ``head``, but MAAC's centralized critic, which reads every agent's tokens, is always a model."""
    model: str | None = None
    """Source of the critic model (default: the agent's own); it must use the actors' tokenizer."""
    type: Literal["v", "q"] = "v"
    """IAC/MAAC: ``v``: V(h) read at the last prompt token; ``q``: Q(h, a) at the last token of prompt +
    response."""
    learning_rate: PositiveFloat | None = None
    """Learning rate of the critic (default: the actors')."""
    value_loss_coef: NonNegativeFloat = 0.5
    """Weight of the value loss."""
    value_clip_range: PositiveFloat | None = 0.2
    """Clip the new value to the old one +- this in the value loss (PPO's, as TRL); None: no clipping
    (CoMLRL's IAC/MAAC). With one pass over one mini-batch the clip never binds."""
    warmup: NonNegativeInt = 0
    """PPO: the first RL steps train only the critic (the policy rests: weights and AdamW state untouched)."""

    def __post_init__(self):
        check_dataclass("model.critic", self)


@dataclass(frozen=True)
class MemorySettings:
    """What a team's passes and stored weights hold (``model.memory``): memory only, the same gradients
    whatever they are; the plan (``plan``) reads them and says which to change when a phase does not fit."""

    forward_token_budget: PositiveInt | None = 2048
    """At most this many tokens per forward/backward pass (None: no cap): a row counts its padded width, or where a
    node's G responses share one prompt pass (MAGRPO) its response plus the prompt once per node. Fewer, larger
    passes are faster; memory grows with it (SmolLM2-135M, fp32: 2048 tokens ~4 GB peak, 8192 ~15 GB): lower it if
    a pass runs out."""
    forward_batch_size: PositiveInt | None = None
    """At most this many rows per forward/backward pass (None: no row cap); a mini-batch's gradients accumulate
    over its passes."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass instead of keeping its activations (every trainable model:
    actors, critics): less memory, one more forward (~1/3 more FLOPs)."""
    weights_dtype: WeightsDtype = "float32"
    """How weights no optimizer updates are stored (references, LoRA bases, frozen backbones, snapshots);
    ``bfloat16`` halves them and needs ``trainer.precision: bf16-mixed``. Trained weights and AdamW's state stay
    fp32 (the master copy), LM heads too (fp32 log-probs) (docs/scale.md)."""
    check: bool = True
    """Print the memory plan per rank before the first step and stop when its peak exceeds the device
    (docs/scale.md); false: neither."""

    def __post_init__(self):
        check_dataclass("model.memory", self)


def logit_temperature(update: UpdateSettings, rollout) -> float:
    """What an update divides the logits by before scoring: the rollouts' sampling temperature with
    ``tempered_logprobs`` (``rollout``: the data module's ``RolloutSettings``), else 1."""
    if not update.tempered_logprobs or rollout is None:
        return 1.0
    return (rollout.tree or rollout.episode).sampling.temperature


BUFFER_FIELDS = frozenset({"size", "schedule"})
"""The ``model.buffer`` fields: every buffered family reads them all."""
KL_FIELDS = frozenset({"coef", "mode", "clamp"})
"""The ``model.kl`` fields the episode algorithms read (MAGRPO reads ``coef``)."""


def read_groups(module, reads: dict[str, frozenset[str]], **given) -> None:
    """Set each group of ``given`` (``name=(class, value)``) on ``module`` as its dataclass, its plain
    values in the saved hyperparameters (checkpoints load ``weights_only``), and refuse the fields
    ``module``'s family does not read (``reads[name]``)."""
    for name, (cls, value) in given.items():
        group = as_group(cls, value)
        setattr(module, name, group)
        saved_groups(module, **{name: group})
        check_unread(name, group, reads[name], type(module).__name__)


def check_unread(group: str, settings, reads: frozenset[str], family: str) -> None:
    """Refuse a field of ``settings`` (``model.<group>``) that ``family`` does not read, set away
    from its default."""
    default = type(settings)()
    for f in fields(settings):
        if f.name not in reads and getattr(settings, f.name) != getattr(default, f.name):
            raise ConfigError(
                f"model.{group}.{f.name}={getattr(settings, f.name)!r}: {family} does not read it (it reads "
                f"{', '.join(sorted(reads)) or 'none of model.' + group}); remove it"
            )
