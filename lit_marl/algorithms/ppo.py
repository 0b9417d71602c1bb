"""PPO on multi-turn episodes with a critic: a value head on the policy's last hidden state, or a
separate critic model with its own head. Token-level GAE over the agent's own tokens (observation
spans skipped, values and GAE state carried across them), or turn-level GAE (one value per turn,
read where the turn's reply starts; its advantage broadcast to the turn's tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lit_marl import ConfigError
from lit_marl.algorithms.critics import ValueHead, load_critic_backbone
from lit_marl.algorithms.episodic import EpisodicModule
from lit_marl.algorithms.settings import CriticSettings, read_groups
from lit_marl.fields import check_fields
from lit_marl.logprobs import final_hidden_states, masked_logprobs
from lit_marl.losses import explained_variance, value_loss
from lit_marl.parallel.collectives import whiten
from lit_marl.returns import token_gae, turn_gae


class PPO(EpisodicModule):
    """PPO on multi-turn episodes with a critic (a value head or a separate model) and token- or turn-level GAE."""

    def __init__(
        self,
        critic: CriticSettings = CriticSettings(),
        **kwargs,
    ):
        """
        Args:
            critic: The critic (``algorithms.settings.CriticSettings``): a value ``head`` on the policy's last
                hidden state (the default) or a separate critic ``model`` (``critic.model``, default the policy's
                source) with its own head, its learning rate, value loss weight and clipping, and ``warmup``: the
                first n RL steps train the critic only (veRL's ``trainer.critic_warmup``; the policy keeps its
                weights and optimizer state, a value head learns on its features without moving them).
            **kwargs: The shared settings of ``EpisodicModule`` (model, update, advantage, kl, discount, ...):
                PPO reads ``model.advantage``'s ``gae`` (token- or turn-level), ``gae_lambda`` and
                ``normalization`` (whitening over the step's action tokens).
        """
        super().__init__(**kwargs)
        check_fields("model", PPO.__init__, locals())
        read_groups(self, {"critic": self.critic_fields}, critic=(CriticSettings, critic))
        self.critic_kind = self.critic.kind or "head"
        if self.critic_kind == "head" and self.critic.model is not None:
            raise ConfigError("model.critic.model is for critic.kind: model; a value head lives on the policy")
        self.critic_learning_rate = self.critic.learning_rate or self.hparams.learning_rate
        self.rl_steps = 0
        self.value_heads: nn.ModuleList | None = None  # one critic per learner
        self.critic_backbones: nn.ModuleList | None = None

    advantage_fields = frozenset({"gae", "gae_lambda", "normalization"})
    """The ``model.advantage`` fields PPO reads."""
    critic_fields = frozenset({"kind", "model", "learning_rate", "value_loss_coef", "value_clip_range", "warmup"})
    """The ``model.critic`` fields PPO reads."""

    def build_models(self) -> None:
        super().build_models()
        if self.value_heads is not None:
            return
        if self.critic_kind == "model":
            source = self.critic.model or self.sources[0]
            self.critic_backbones = nn.ModuleList(load_critic_backbone(source, self.agents[:1]) for _ in self.learners)
        hidden = [
            (self.critic_backbones[i] if self.critic_backbones else self.model_of(i)).config.hidden_size
            for i in range(len(self.learners))
        ]
        self.value_heads = nn.ModuleList(ValueHead(h) for h in hidden)

    def configure_optimizers(self):
        optimizers = []
        for index, roles in enumerate(self.learners):
            critic = list(self.value_heads[index].parameters())
            if self.critic_backbones is not None:
                critic += [p for p in self.critic_backbones[index].parameters() if p.requires_grad]
            policy = self.agents[roles[0]].trainable_parameters()
            groups = [
                {"params": policy, "lr": self.hparams.learning_rate, "role": "policy"},
                {"params": critic, "lr": self.critic_learning_rate, "role": "critic"},
            ]
            optimizers.append(torch.optim.AdamW(groups, weight_decay=self.weight_decay))
        return optimizers

    def forward(self, samples, learner: int = 0):
        """Per-token log-probs (at the agent's own tokens, as ``EpisodicModule.forward``) and values
        ``[B, L]``; entry t is about token t given the ones before."""
        ids, mask = samples.input_ids, samples.attention_mask
        shared = self.critic_backbones is None  # the value head reads the policy's hidden states
        if shared or not getattr(samples, "values_only", False):
            model, temperature = self.model_of(learner), self.logit_temperature
            logprobs, hidden = masked_logprobs(
                model, ids, mask, samples.loss_mask, hidden=shared, temperature=temperature
            )
        else:  # the value pass with a critic of its own: the policy has nothing to give
            logprobs = torch.zeros(ids.shape, device=ids.device)
        if not shared:
            hidden = final_hidden_states(self.critic_backbones[learner], ids, mask)
        if self.warming_up:  # the value head reads the policy's features without training them
            hidden = hidden.detach()
        values = self.value_heads[learner](hidden[:, :-1])
        return logprobs, F.pad(values, (1, 0))

    @torch.no_grad()
    def behaviour(self, batch, learner: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The behaviour log-probs and the old values: with a value head, one pass of the policy gives
        both (its LM head at the agent's tokens, the value head on its last hidden states); a critic
        model of its own runs its own pass."""
        if self.critic_backbones is None:
            return self.chunked(lambda *rows: self.forward(_Rows(*rows), learner), batch, self.model_of(learner))
        logprobs, _ = super().behaviour(batch, learner)
        values_only = lambda ids, mask, _: self.forward(_Rows(ids, mask), learner)[1]  # noqa: E731
        return logprobs, self.chunked(values_only, batch, self.critic_backbones[learner])

    @torch.no_grad()
    def advantages(self, samples, learner, batch, token_rewards, values):
        mask = batch.loss_mask.float()
        if self.advantage.gae == "token":
            advantages, returns = token_gae(
                token_rewards, values * mask, mask, self.discount, self.advantage.gae_lambda
            )
            value_mask = mask
        else:
            alive = batch.alive
            first = batch.turn_starts()  # the value of a turn is read where its reply starts
            turn_values = values.gather(1, first) * alive
            per_turn = batch.per_turn(token_rewards)
            turn_adv, turn_ret = turn_gae(per_turn, turn_values, alive, self.discount, self.advantage.gae_lambda)
            advantages = batch.to_tokens(turn_adv)
            value_mask = torch.zeros_like(values)
            returns = torch.zeros_like(values)
            rows, turns = torch.nonzero(alive, as_tuple=True)
            value_mask[rows, first[rows, turns]] = 1.0
            returns[rows, first[rows, turns]] = turn_ret[rows, turns]
        if self.advantage.normalized():
            advantages = whiten(advantages, mask)
        returns_v, values_v = returns[value_mask.bool()], values[value_mask.bool()]
        critic = {"value_mean": values_v.mean(), "explained_variance": explained_variance(returns_v, values_v)}
        self.record({f"{self.learner_name(learner)}/{key}": value for key, value in critic.items()}, len(values))
        return {**samples, "advantages": advantages, "returns": returns, "old_values": values, "value_mask": value_mask}

    @property
    def warming_up(self) -> bool:
        """Whether this RL step trains the critic only (``critic_warmup``)."""
        return self.rl_steps < self.critic.warmup

    @property
    def resting_roles(self) -> frozenset:
        """While ``warming_up`` the policy's parameter group sits the optimizer steps out
        (``updates.rest``): its weights, AdamW moments and step count stay bit for bit, so weight
        decay does not move it and its first real update after the warm-up is a first step."""
        return frozenset({"policy"}) if self.warming_up else frozenset()

    def rl_step(self, batches, batch_idx: int) -> None:
        self.record({"train/critic_warmup": float(self.warming_up)})
        super().rl_step(batches, batch_idx)
        self.rl_steps += 1

    def loss(self, samples, stats: dict, learner: int) -> torch.Tensor:
        """``EpisodicModule.loss``; while ``warming_up`` its policy terms count 0 (and the policy's
        parameter group rests: ``resting_roles``)."""
        terms = super().loss(samples, stats, learner)
        return terms * terms.new_tensor([0.0, 1.0]) if self.warming_up else terms

    def rank_state(self) -> dict:
        return {**super().rank_state(), "rl_steps": self.rl_steps}

    def load_rank_state(self, state: dict) -> None:
        super().load_rank_state(state)
        self.rl_steps = state.get("rl_steps", 0)

    def extra_loss(self, samples, values, learner) -> torch.Tensor:
        """value_loss_coef x 0.5 x (value - return)^2 summed over the value positions (each action token
        under token-level GAE, each turn's first token under turn-level GAE), clipped around the old
        value (PPO2); the step divides it by the number of value positions, so the coefficient weighs
        a mean squared error per value in both GAE modes."""
        clip = self.critic.value_clip_range
        return (
            self.critic.value_loss_coef
            * 0.5
            * value_loss(values, samples.old_values, samples.returns, samples.value_mask, clip, "sum")
        )


class _Rows:
    """The fields ``PPO.forward`` reads, for the behaviour pass over a raw episode batch. Without a
    ``loss_mask`` (the values of a critic model of its own) the policy does not run at all."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor | None = None):
        self.input_ids, self.attention_mask, self.loss_mask = input_ids, attention_mask, loss_mask
        self.values_only = loss_mask is None
