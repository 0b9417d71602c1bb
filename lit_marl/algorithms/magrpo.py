"""MAGRPO: multi-agent group-relative policy optimization on joint rollout trees.

Each agent's response is scored by the joint reward of the joint action(s) it took part in; the
advantage compares it with its siblings (the G responses the agent sampled at the same node).
Each agent then takes one policy-gradient step on its own samples with its own optimizer.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.algorithms.settings import (
    BUFFER_FIELDS,
    AdvantageSettings,
    BufferSettings,
    KLSettings,
    UpdateSettings,
    logit_temperature,
    read_groups,
)
from lit_marl.fields import as_group, check_fields
from lit_marl.logprobs import completion_logits, completion_logprobs, token_entropy, token_logprobs
from lit_marl.losses import k3_kl, masked_sum, reinforce
from lit_marl.metrics import Timer, rollout_correction
from lit_marl.parallel.collectives import all_ranks_max, padded_steps
from lit_marl.returns import AdvantageMode, group_advantages
from lit_marl.rollout.batch import AgentSamples, RolloutBatch
from lit_marl.rollout.buffer import RolloutBuffer, batch_turns, minibatches


def fixed_mode(family: type, advantage: AdvantageSettings) -> AdvantageSettings:
    """``advantage`` with the baseline a named variant fixes (``family.baseline``); another mode
    given to it is refused."""
    if family.baseline is None or advantage.mode == family.baseline:
        return advantage
    if advantage.mode != AdvantageSettings.mode:
        raise ConfigError(
            f"model.advantage.mode={advantage.mode!r}: {family.__name__} is MAGRPO with mode {family.baseline!r}; "
            f"remove it, or use MAGRPO with model.advantage.mode: {advantage.mode}"
        )
    return replace(advantage, mode=family.baseline)


class MAGRPO(AgentTeamModule):
    """Multi-agent GRPO on joint rollout trees: each response baselined by its G siblings at the same node."""

    buffered = True

    def __init__(
        self,
        advantage: AdvantageSettings = AdvantageSettings(),
        update: UpdateSettings = UpdateSettings(),
        buffer: BufferSettings = BufferSettings(),
        kl: KLSettings = KLSettings(),
        **kwargs,
    ):
        """
        Args:
            advantage: How each node's returns become advantages (``algorithms.settings.AdvantageSettings``):
                MAGRPO reads ``mode`` (the baseline within a node's G siblings; the named variants fix it),
                ``normalization``, ``normalization_form`` and ``std_floor``.
            update: How the buffered samples become optimizer steps (``algorithms.settings.UpdateSettings``):
                MAGRPO reads ``train_batch_size`` (groups: a tree node's G responses), ``logprob_reduction``
                (REINFORCE on the sum or the mean of a response's token log-probs) and ``rollout_is_cap``.
            buffer: When an update fires and in which order (``algorithms.settings.BufferSettings``).
            kl: A KL(policy || reference) term (``algorithms.settings.KLSettings``): MAGRPO reads ``coef``, the weight
                of each response's summed k3 estimate, subtracted from the agent's reward before returns (the
                reference: the initial weights; with LoRA the base model with adapters disabled, no copy).
            **kwargs: The team's settings (model, lora, learning_rate, ...): see ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        check_fields("model", MAGRPO.__init__, locals())
        advantage = fixed_mode(type(self), as_group(AdvantageSettings, advantage))
        groups = {"advantage": self.advantage_fields, "update": self.update_fields, "buffer": BUFFER_FIELDS}
        given = {"advantage": (AdvantageSettings, advantage), "update": (UpdateSettings, update)}
        given |= {"buffer": (BufferSettings, buffer), "kl": (KLSettings, kl)}
        read_groups(self, groups | {"kl": frozenset({"coef"})}, **given)

    update_fields = frozenset({"train_batch_size", "logprob_reduction", "rollout_is_cap", "tempered_logprobs"})
    """The ``model.update`` fields MAGRPO reads."""
    advantage_fields = frozenset({"mode", "normalization", "normalization_form", "std_floor"})
    """The ``model.advantage`` fields MAGRPO reads."""
    baseline: AdvantageMode | None = None
    """The baseline a named variant fixes (MAREINFORCE ``raw``, MAReMax ``max``, MARLOO ``rloo``)."""
    logit_temperature = 1.0
    """What the update divides the logits by before scoring (``model.update.tempered_logprobs``), set in ``setup``."""

    def build_models(self) -> None:
        super().build_models()
        if self.kl.coef > 0:
            self.build_references()

    def response_penalties(self, batch: RolloutBatch) -> list[torch.Tensor] | None:
        """kl.coef x KL(policy || reference) of every agent's responses (None without a KL term)."""
        if self.kl.coef == 0:
            return None
        with Timer() as timer:
            penalties = [self.reference_kl(i, samples) for i, samples in enumerate(batch.agents)]
        self.record({"perf/penalty_s": timer.seconds})
        return penalties

    @torch.no_grad()
    def reference_kl(self, index: int, samples: AgentSamples) -> torch.Tensor:
        """kl.coef x KL(policy || reference) of each response (row): the k3 estimate exp(d) - d - 1
        with d = log p_ref - log p, summed over the response's tokens. Scored as the update scores
        (``computing(update=True)``): per-layer FSDP gathers layer by layer in lockstep passes, neither
        model whole."""
        model, learner = self.agents[index].model, self.learner_of(index)
        out = torch.zeros(len(samples), device=samples.input_ids.device)
        frozen = self.references[learner] if self.references is not None else model  # LoRA: adapters off
        with self.computing(update=True):
            for rows in self.passes(samples, [model, frozen], shared_prompts=True):
                part = samples.select(rows)
                args = (part.input_ids, part.attention_mask, part.num_completion, self.prompt_groups(part))
                logprobs = completion_logprobs(model, *args, temperature=self.logit_temperature)
                with self.reference_model(learner) as reference:
                    d = completion_logprobs(reference, *args, temperature=self.logit_temperature) - logprobs
                out[rows] = (k3_kl(d) * part.completion_mask).sum(-1).float()
        self.record({f"agent{index}/kl_ref": float(out.mean())}, weight=len(out))
        return self.kl.coef * out

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "each response with its siblings at a tree node")
        self.logit_temperature = logit_temperature(self.update, self.rollout_settings)

    def advantages(self, samples: AgentSamples) -> AgentSamples:
        """``samples`` with each response's advantage against its siblings' baseline; rows come
        grouped by node, all groups of one size (one per tree node)."""
        num_groups = int(samples.group_ids.max()) + 1
        grouped = samples.returns.view(num_groups, -1)
        settings = self.advantage
        adv = group_advantages(
            grouped, settings.mode, settings.normalized(), settings.std_floor, settings.normalization_form
        )
        return samples.with_advantages(adv.reshape(-1))

    def loss(self, samples: AgentSamples, stats: dict | None, learner: int) -> torch.Tensor:
        """Learner ``learner``'s loss on ``samples``, summed over rows: -A * (sum or mean of the
        log-probs of the response's tokens, end token included, padding excluded). ``stats`` gathers
        the policy's entropy over the response tokens (a diagnostic: no gradient)."""
        args = (samples.input_ids, samples.attention_mask, samples.num_completion)
        logits = completion_logits(self.model_of(learner), *args, prompt_groups=self.prompt_groups(samples))
        logprobs = token_logprobs(logits, samples.input_ids[:, -samples.num_completion :], self.logit_temperature)
        if stats is not None:
            with torch.no_grad():
                mask = samples.completion_mask.float()
                stats["entropy"] += float((token_entropy(logits, self.logit_temperature) * mask).sum())
                stats["tokens"] += float(mask.sum())
        mask = samples.completion_mask
        weights = rollout_correction(
            self.step_log, logprobs.detach(), samples, mask, self.update.rollout_is_cap, self.logit_temperature
        )
        if weights is not None:  # truncated importance sampling
            logprobs = logprobs * weights
        seq_logprob = masked_sum(logprobs, samples.completion_mask, self.update.logprob_reduction)
        return reinforce(seq_logprob, samples.advantages).sum()

    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        per_agent = [self.advantages(samples) for samples in batch.agents]
        for role, samples in enumerate(per_agent):
            lengths = samples.completion_mask.sum(-1).float()
            self.record({f"agent{role}/completion_len": float(lengths.mean())}, weight=len(samples))
            self.step_log.distribution(f"agent{role}/advantage", samples.advantages)
            self.step_log.distribution(f"agent{role}/return", samples.returns)
        self.buffer_step(batch, per_agent)

    def flush_buffers(self) -> None:
        """Update every learner on all samples in its roles' buffers, one optimizer step per mini-batch."""
        if not all_ranks_max(len(self.rollout_buffers[0]), self.device):
            return
        all_losses = []
        with Timer() as train_time:
            for index, roles in enumerate(self.learners):
                agent = self.agents[roles[0]]
                merged = RolloutBuffer()  # a shared model learns from every role it played
                for role in roles:
                    merged.add(self.rollout_buffers[role].drain(agent.pad_token_id))
                samples = merged.drain(agent.pad_token_id)  # None: this rank has nothing buffered
                batches = (
                    []
                    if samples is None
                    else minibatches(
                        samples, self.update.train_batch_size, self.shuffle_generator, self.buffer.schedule
                    )
                )
                losses, stats = [], {"entropy": 0.0, "tokens": 0.0}
                turns = batch_turns(samples, batches, self.buffer.schedule)
                for rows in padded_steps(batches, self.device, turns):
                    kept, count = None, 0
                    if rows is not None:
                        batch = samples.select(rows)
                        # Rows with zero advantage carry no gradient: skip their forward/backward;
                        # the loss stays normalized by the whole mini-batch.
                        kept_rows = torch.nonzero(batch.advantages != 0).flatten()
                        kept = batch.select(kept_rows) if kept_rows.numel() else None
                        count = len(batch)
                    loss_fn = lambda mb, i=index, s=stats: self.loss(mb, s, i)  # noqa: E731
                    skipped = count > 0 and kept is None  # every row's advantage is 0: a zero-loss step
                    step = dict(count=count, shared_prompts=True, skipped_zero_loss=skipped)
                    losses.append(self.update_agent(index, kept, loss_fn, **step))
                name = self.learner_name(index)
                # the losses are over every rank's rows already; the steps are the same on every rank
                self.record({f"{name}/loss": sum(losses) / len(losses), f"{name}/optimizer_steps": len(losses)})
                if samples is not None:
                    self.record({f"{name}/advantage_abs": float(samples.advantages.abs().mean())}, len(samples))
                if stats["tokens"]:  # over the tokens this rank trained on (rows with advantage 0 skip their pass)
                    self.record({f"{name}/entropy": stats["entropy"] / stats["tokens"]}, weight=stats["tokens"])
                all_losses += losses
        self.record({"train/loss": sum(all_losses) / len(all_losses), "perf/train_s": train_time.seconds})


class MAREINFORCE(MAGRPO):
    """MAGRPO without a baseline: each response's advantage is its return."""

    baseline = "raw"


class MAReMax(MAGRPO):
    """MAGRPO with the group's best return as the baseline."""

    baseline = "max"


class MARLOO(MAGRPO):
    """MAGRPO with the leave-one-out baseline (the mean of the other G-1 siblings)."""

    baseline = "rloo"


class CentralizedMAGRPO(MAGRPO):
    """CoMLRL's centralized MAGRPO: ONE joint actor writes every role's output in one completion
    (``data.centralized_adapter``), G samples per task baselined by their mean; the joint text is
    split into roles only for the reward. Single-turn; the loss is MAGRPO's with one agent."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.rollout_settings is None or not self.rollout_settings.centralized:
            raise ConfigError(
                "CentralizedMAGRPO needs a joint actor: set data.centralized_adapter (e.g. "
                "lit_marl.envs.centralized:TaggedAdapter) with data.agent_prompts (one per role) and data.reward_fn"
            )
