"""What the multi-turn episode algorithms share (PPO, GRPO, RLOO): whole episodes as training rows,
a clipped surrogate over the agent's own tokens, several epochs over mini-batches of tasks, an
optional KL to a reference (the base weights with LoRA disabled, or a frozen copy), and per-turn
metrics. Subclasses say how advantages (and, for PPO, values) are made."""

from __future__ import annotations

import torch

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.algorithms.settings import (
    KL_FIELDS,
    AdvantageSettings,
    KLSettings,
    UpdateSettings,
    logit_temperature,
    read_groups,
)
from lit_marl.fields import check_fields
from lit_marl.logprobs import masked_logprobs, sft_loss
from lit_marl.losses import clip_fraction, clipped_surrogate, k3_kl
from lit_marl.metrics import Timer, record_stats, rollout_correction
from lit_marl.parallel.collectives import all_ranks_sum, padded_steps
from lit_marl.rollout.batch import TrajectorySamples, length_passes
from lit_marl.rollout.buffer import minibatches
from lit_marl.rollout.demos import DemoSamples
from lit_marl.rollout.episode import EpisodeBatch, render_episode


class EpisodicModule(AgentTeamModule):
    """The base of the episode algorithms (PPO, GRPO, RLOO): a step's episodes become
    ``TrajectorySamples`` per learner (``prepare``: the behaviour log-probs, the reference's where
    KL applies, and the subclass's ``advantages``), trained in ``ppo_epochs`` passes of mini-batches
    with the clipped surrogate (``loss``) plus the subclass's ``extra_loss`` (PPO's value loss)."""

    def __init__(
        self,
        update: UpdateSettings = UpdateSettings(),
        advantage: AdvantageSettings = AdvantageSettings(),
        kl: KLSettings = KLSettings(),
        **kwargs,
    ):
        """
        Args:
            update: How a step's episodes become optimizer steps (``algorithms.settings.UpdateSettings``): the
                episode algorithms read ``ppo_epochs`` (passes over the step's episodes), ``train_batch_size``
                (groups: a task's G episodes; None: one step per pass), ``clip_range``, ``dual_clip``,
                ``rollout_is_cap``, ``skip_signalless_steps`` (GRPO, RLOO without a KL term) and ``sft_coef``
                (each step also learns a batch of ``data.demos``).
            advantage: How returns become advantages (``algorithms.settings.AdvantageSettings``): each family
                reads its estimator's fields (``advantage_fields``: PPO's GAE, GRPO's and RLOO's group baselines).
            kl: A KL(policy || reference) term (``algorithms.settings.KLSettings``): its ``coef`` (0: none), ``mode``
                (a loss term or a per-token reward penalty) and ``clamp``.
            **kwargs: The team's settings (model, lora, learning_rate, discount, memory, ...): see
                ``AgentTeamModule``; each agent plays its own token sequence.
        """
        kwargs.setdefault("num_agents", 1)  # one agent unless given (the CLI links it to the environment's)
        super().__init__(**kwargs)
        check_fields("model", EpisodicModule.__init__, locals())
        groups = {"update": self.update_fields, "advantage": self.advantage_fields, "kl": KL_FIELDS}
        given = {"update": (UpdateSettings, update), "advantage": (AdvantageSettings, advantage)}
        read_groups(self, groups, kl=(KLSettings, kl), **given)

    update_fields = frozenset(
        {"ppo_epochs", "train_batch_size", "clip_range", "dual_clip", "rollout_is_cap", "skip_signalless_steps"}
        | {"tempered_logprobs", "sft_coef"}
    )
    """The ``model.update`` fields the episode algorithms read."""
    advantage_fields: frozenset[str] = frozenset()
    """The ``model.advantage`` fields the family reads."""
    demo_draws = 0
    """Batches of demonstrations RL steps have learned so far (``model.update.sft_coef``; in checkpoints)."""
    logit_temperature = 1.0
    """What the update divides the logits by before scoring (``model.update.tempered_logprobs``), set in ``setup``."""

    def build_models(self) -> None:
        super().build_models()
        if self.kl.coef > 0:
            self.build_references()

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.rollout_settings is not None:
            self.rollout_settings.require("episodes", type(self).__name__)
        self.logit_temperature = logit_temperature(self.update, self.rollout_settings)
        critic = type(self).extra_loss is not EpisodicModule.extra_loss
        if self.update.skip_signalless_steps and (critic or self.kl.coef > 0 or self.update.sft_coef > 0):
            raise ConfigError(
                f"model.update.skip_signalless_steps: {type(self).__name__}'s steps all carry a gradient (a critic's "
                "value loss, a KL term or demonstrations: model.update.sft_coef): use it with GRPO or RLOO without "
                "model.kl.coef and model.update.sft_coef, or leave it out"
            )
        if stage == "fit" and self.update.sft_coef > 0 and not (self.rollout_settings and self.rollout_settings.demos):
            raise ConfigError(
                f"model.update.sft_coef={self.update.sft_coef:g}: RL steps learn demonstrations too, and there are "
                "none; set data.demos.path (the SFT phase's: scripts/make_demos.py) or model.update.sft_coef: 0"
            )

    # ------------------------------------------------------------------ what subclasses provide
    def advantages(
        self, samples: dict, learner: int, batch: EpisodeBatch, token_rewards: torch.Tensor, values: torch.Tensor | None
    ) -> dict:
        """``samples`` (the fields of learner ``learner``'s rows) with ``advantages``, ``returns``,
        ``old_values`` and ``value_mask`` filled in, from the episodes ``batch``, each token's reward
        and ``values`` (the critic's, from ``behaviour``)."""
        raise NotImplementedError

    def extra_loss(self, samples: TrajectorySamples, outputs, learner: int) -> torch.Tensor:
        """A second loss term summed over the ``value_mask`` positions, e.g. PPO's value loss; the
        step takes its mean over those positions (``rl_step``); none by default."""
        return torch.zeros((), device=samples.input_ids.device)

    def forward(self, samples: TrajectorySamples, learner: int = 0):
        """Per-token log-probs ``[B, L]`` of a learner's policy at its own tokens (``loss_mask``; 0
        elsewhere: no loss reads them); subclasses add values."""
        model = self.model_of(learner)
        ids, mask, loss_mask = samples.input_ids, samples.attention_mask, samples.loss_mask
        return masked_logprobs(model, ids, mask, loss_mask, temperature=self.logit_temperature)[0], None

    # ------------------------------------------------------------------ the step
    def signalless(self, mini: TrajectorySamples | None) -> bool:
        """Whether no row of this step, on any rank, has an advantage above 1e-6 in size (tied returns
        leave rounding noise where they are not normalized); one collective, every rank."""
        local = 0.0 if mini is None else float((mini.advantages.abs() > 1e-6).any())
        return all_ranks_sum(local, self.device) == 0.0

    def micro_batches(self, rows, shared_prompts: bool = False) -> list[torch.Tensor]:
        """Episodes of similar length share a pass (``rollout.batch.length_passes``): a pass is trimmed
        to its longest episode, so this computes the fewest padding tokens the budget allows."""
        lengths = rows.attention_mask.sum(-1)  # left-padded: a row spans its length
        return [
            r.to(self.device)
            for r in length_passes(lengths, self.memory.forward_token_budget, self.memory.forward_batch_size)
        ]

    def chunked(self, fn, batch: EpisodeBatch, model: torch.nn.Module):
        """``fn(input_ids, attention_mask, loss_mask)`` over the batch in the passes of
        ``micro_batches`` (each a forward of ``model``: ``passes``), each pass's rows trimmed of the
        columns that are left padding in all of them (as the loss passes are: ``TrajectorySamples.select``),
        its ``[b, l]`` results padded back on the left with zeros into their rows; ``fn`` may return a
        tuple of them (each filled)."""
        width, outs = batch.input_ids.shape[1], None
        for r in self.passes(batch, [model]):
            first = int((batch.attention_mask[r].cumsum(-1) == 0).sum(-1).min())
            out = fn(batch.input_ids[r, first:], batch.attention_mask[r, first:], batch.loss_mask[r, first:])
            out = out if isinstance(out, tuple) else (out,)
            if outs is None:
                outs = tuple(o.new_zeros((len(batch.input_ids), width)) for o in out)
            for full, o in zip(outs, out):
                full[r, first:] = o
        return outs if len(outs) > 1 else outs[0]

    @torch.no_grad()
    def reference_logprobs(self, batch: EpisodeBatch, learner: int) -> torch.Tensor:
        with self.reference_model(learner) as reference:
            return self.chunked(
                lambda *rows: masked_logprobs(reference, *rows, temperature=self.logit_temperature)[0], batch, reference
            )

    @torch.no_grad()
    def behaviour(self, batch: EpisodeBatch, learner: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs ``[B, L]`` at the agent's own tokens before this step's update (the
        ratio's denominator), and the critic's values ``[B, L]`` where the algorithm has one (PPO:
        one pass gives both when the value head reads the policy's hidden states); None here."""
        model = self.model_of(learner)
        return self.chunked(
            lambda *rows: masked_logprobs(model, *rows, temperature=self.logit_temperature)[0], batch, model
        ), None

    @torch.no_grad()
    def prepare(self, batch: EpisodeBatch, learner: int) -> TrajectorySamples:
        old_logprobs, values = self.behaviour(batch, learner)
        token_rewards = batch.token_rewards(batch.rewards).to(old_logprobs.device)
        rollout = None if batch.rollout_logprobs is None else batch.rollout_logprobs.to(old_logprobs.device)
        ref = None
        if self.kl.coef > 0:
            ref = self.reference_logprobs(batch, learner)
            tokens = batch.loss_mask.sum().clamp(min=1)  # KL(policy || reference) per sampled token
            kl = float((k3_kl(ref - old_logprobs) * batch.loss_mask).sum() / tokens)
            self.record({f"{self.learner_name(learner)}/kl_ref": kl}, weight=float(tokens))
            if self.kl.mode == "reward":
                delta = old_logprobs - ref  # the per-token KL estimate of the sampled tokens
                token_rewards = token_rewards - self.kl.coef * delta * batch.loss_mask
        fields = dict(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            loss_mask=batch.loss_mask,
            old_logprobs=old_logprobs,
            ref_logprobs=ref if self.kl.mode == "loss" else None,
            rollout_logprobs=rollout,
            group_ids=batch.group_ids.to(batch.input_ids.device),
            turn_ids=torch.zeros_like(batch.group_ids).to(batch.input_ids.device),
        )
        return TrajectorySamples(**self.advantages(fields, learner, batch, token_rewards, values))

    def loss(self, samples: TrajectorySamples, stats: dict, learner: int) -> torch.Tensor:
        """``[policy, extra]``: the policy terms summed over this micro-batch's action tokens and
        ``extra_loss`` summed over its value positions (the step divides each by its own count)."""
        logprobs, outputs = self.forward(samples, learner)
        mask = samples.loss_mask.float()
        ratio_terms = (
            logprobs,
            samples.old_logprobs,
            samples.advantages,
            self.update.clip_range,
            self.update.dual_clip,
        )
        weights = rollout_correction(
            self.step_log, samples.old_logprobs, samples, mask, self.update.rollout_is_cap, self.logit_temperature
        )
        weight = mask if weights is None else mask * weights  # truncated importance sampling
        loss = (clipped_surrogate(*ratio_terms) * weight).sum()
        if samples.ref_logprobs is not None:
            loss = loss + self.kl.coef * (k3_kl(samples.ref_logprobs - logprobs, self.kl.clamp) * mask).sum()
        with torch.no_grad():
            log_ratio = logprobs - samples.old_logprobs
            stats["approx_kl"] += float((k3_kl(log_ratio) * mask).sum())
            stats["clip_frac"] += float((clip_fraction(log_ratio, self.update.clip_range) * mask).sum())
            stats["tokens"] += float(mask.sum())
        return torch.stack([loss, self.extra_loss(samples, outputs, learner)])

    def rl_step(self, batches: list[EpisodeBatch], batch_idx: int) -> None:
        """Each learner (a model) updates on the sequences of every agent it plays."""
        with Timer() as train_time, self.computing(update=True):
            stats = dict.fromkeys(("approx_kl", "clip_frac", "tokens", "skipped_steps"), 0.0)
            first, all_losses, all_demo_losses, drawn = None, [], [], {}
            for index, roles in enumerate(self.learners):
                parts = [self.prepare(batches[role], index) for role in roles]
                if first is None:
                    first = parts[0]
                samples = TrajectorySamples.cat(parts, self.agents[roles[0]].pad_token_id)
                losses, demo_losses = [], []
                for _ in range(self.update.ppo_epochs):
                    order = minibatches(samples, self.update.train_batch_size, self.shuffle_generator)
                    for rows in padded_steps(order, self.device):
                        mini = None if rows is None else samples.select(rows)
                        if self.update.skip_signalless_steps and self.signalless(mini):
                            stats["skipped_steps"] += 1
                            continue
                        # the policy terms a mean over the action tokens, the extra term over the value positions
                        counts = (0.0, 0.0) if mini is None else mini.loss_counts()
                        loss_fn = lambda mb, i=index: self.loss(mb, stats, i)  # noqa: E731
                        also = self.demo_term(index, roles, len(losses), drawn)
                        loss = self.update_agent(index, mini, loss_fn, count=counts, also=also)
                        if also is not None:
                            loss, demo_loss = loss
                            demo_losses.append(demo_loss / self.update.sft_coef)
                        losses.append(loss)
                all_losses += losses
                name = self.learner_name(index)
                self.record({f"{name}/optimizer_steps": len(losses)})
                if losses:  # every step skipped: no loss to report
                    self.record({f"{name}/loss": sum(losses) / len(losses)})
                if demo_losses:
                    self.record({f"{name}/sft_loss": sum(demo_losses) / len(demo_losses)})
                    all_demo_losses += demo_losses
            self.demo_draws += len(drawn)
        if all_losses:  # empty only where every step was skipped, alike on every rank (a collective decided)
            tokens = max(stats["tokens"], 1)  # over this rank's tokens: averaged over ranks by them
            kl, clipped = stats["approx_kl"] / tokens, stats["clip_frac"] / tokens
            self.record({"train/approx_kl": kl, "train/clip_frac": clipped}, tokens)
            self.record({"train/loss": sum(all_losses) / len(all_losses)})
        if all_demo_losses:  # the SFT phase's key: one curve over both phases
            self.record({"train/sft_loss": sum(all_demo_losses) / len(all_demo_losses)})
        self.record({"perf/train_s": train_time.seconds})
        if self.update.skip_signalless_steps:
            self.record({"train/skipped_steps": stats["skipped_steps"]})
        self.log_episodes(batches[0], "train", first)
        if self.sample_step():
            self.step_log.text("train/sample", render_episode(batches, list(self.agents)))

    def demo_term(self, learner: int, roles: list[int], step: int, drawn: dict) -> tuple | None:
        """The demonstrations' term of this update's ``step``-th optimizer step of ``learner``
        (``optimizer_step_on``'s ``also``): ``sft_coef`` times the negative log-likelihood of the next batch
        of ``data.demos`` (every learner's step ``step`` learns the same batch: rendered once, in ``drawn``),
        a mean over its tokens; None without ``sft_coef``, or while the policy rests (PPO's critic warm-up:
        the batch is not learned, so not drawn)."""
        if self.update.sft_coef <= 0 or "policy" in self.resting_roles:
            return None
        if step not in drawn:
            drawn[step] = self.trainer.datamodule.rl_demos(list(self.agents), self.demo_draws + step)
        agent = self.agents[roles[0]]
        demos = DemoSamples.cat([drawn[step][r] for r in roles], agent.pad_token_id)
        coef = self.update.sft_coef
        return demos, lambda mb, m=agent.model: coef * sft_loss(m, mb), float(demos.loss_mask.sum()), agent.model

    def rank_state(self) -> dict:
        return {**super().rank_state(), "demo_draws": self.demo_draws}

    def load_rank_state(self, state: dict) -> None:
        super().load_rank_state(state)
        self.demo_draws = state.get("demo_draws", 0)

    def log_episodes(self, batch: EpisodeBatch, prefix: str, samples: TrajectorySamples | None = None) -> None:
        """The team's outcomes (the same in every agent's batch): a training step records them
        (``record``, per turn as ``turn_<t>/``, with the reward's spread and one rendered episode);
        an evaluation batch logs them under ``prefix``."""
        size = float(len(batch.won))
        values = {
            "won": batch.won.float().mean(),
            "lost": batch.lost.float().mean(),
            "truncated": batch.truncated.float().mean(),
            "turns": batch.num_turns.float().mean(),
            "final_score": (batch.scores[:, -1] / batch.max_score).mean(),
        }
        episode_reward = batch.rewards.sum(dim=1)
        if prefix != "train":
            self.log_eval(
                {f"{prefix}/{k}": float(v) for k, v in {"reward": episode_reward.mean(), **values}.items()}, size
            )
            return
        log = self.step_log
        log.add({f"train/{k}": v for k, v in values.items()}, weight=size)
        record_stats(log, batch.stats, size)  # counts summed over ranks, the rest means
        log.distribution("train/reward", episode_reward)
        alive = batch.alive
        for t in range(alive.shape[1]):
            live = alive[:, t]
            log.distribution(f"turn_{t}/reward", batch.rewards[live, t])
            log.add({f"turn_{t}/episodes": float(live.sum())}, reduce="sum")
            if samples is not None and live.any():
                turn = batch.turn_ids == t
                log.add({f"turn_{t}/advantage": float(samples.advantages[turn].mean())}, weight=float(live.sum()))
        if samples is not None:
            log.distribution("train/advantage", samples.advantages[samples.loss_mask.bool()])

    def validation_step(self, batches: list[EpisodeBatch], batch_idx: int) -> None:
        self.log_episodes(batches[0], "val")  # the outcome is the team's

    def test_step(self, batches: list[EpisodeBatch], batch_idx: int) -> None:
        self.log_episodes(batches[0], "test")
