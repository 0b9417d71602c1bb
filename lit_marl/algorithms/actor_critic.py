"""Actor-critic on single-trajectory episodes: IAC (a critic per agent) and MAAC (one centralized
critic over the joint state).

The rollout is the joint tree with one response per agent and node (``data.num_generations=1``):
one joint trajectory per task, each turn's node linked to the next by ``next_group``. At an update
every row (one agent's turn) gets the one-step TD target y = r + gamma * V(h_next), gamma being
``data.discount``, with no bootstrap after the final or an early-terminated turn, and the advantage
A = y - V(h), optionally z-scored per (agent, turn). The actor's loss is CoMLRL's ratio-free
-log pi(a) * A, or the clipped PPO surrogate against the behaviour log-probs over several epochs,
with an entropy bonus and a ``target_kl`` stop: with per-agent value heads that is IPPO, with the
centralized critic MAPPO.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule, Timer
from lit_marl.algorithms.ppo import ValueHead
from lit_marl.callbacks.buffer_flush import BufferFlush
from lit_marl.generation import completion_forward, left_pad
from lit_marl.models import load_model_and_tokenizer
from lit_marl.returns import td_advantages, td_targets, value_loss
from lit_marl.rollout.batch import AgentSamples, RolloutBatch
from lit_marl.rollout.buffer import RolloutBuffer, minibatches

CriticType = Literal["v", "q"]


@dataclass
class CriticInputs:
    """What a critic model reads: token rows (left-padded) and the position of each row's value."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B]
    old_values: torch.Tensor | None = None  # [B]
    targets: torch.Tensor | None = None  # [B]
    turn_ids: torch.Tensor | None = None  # [B]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "CriticInputs":
        return CriticInputs(**{k: None if v is None else v[rows] for k, v in vars(self).items()})

    @staticmethod
    def cat(parts: list["CriticInputs"], pad_id: int) -> "CriticInputs":
        """Rows of several parts (the roles one critic serves), re-left-padded to one width."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.input_ids.shape[1] for p in parts)
        fields = {
            "input_ids": torch.cat(
                [nn.functional.pad(p.input_ids, (width - p.input_ids.shape[1], 0), value=pad_id) for p in parts]
            ),
            "attention_mask": torch.cat(
                [nn.functional.pad(p.attention_mask, (width - p.attention_mask.shape[1], 0)) for p in parts]
            ),
            "positions": torch.cat([p.positions + width - p.input_ids.shape[1] for p in parts]),
        }
        for name in ("old_values", "targets", "turn_ids"):
            values = [getattr(p, name) for p in parts]
            fields[name] = None if any(v is None for v in values) else torch.cat(values)
        return CriticInputs(**fields)


def team_reward(per_agent: list[AgentSamples]) -> torch.Tensor:
    """The joint reward of each row: the mean of the agents' rewards (MAAC's critic learns it)."""
    return torch.stack([s.rewards for s in per_agent]).mean(0)


def read_positions(samples: AgentSamples, critic_type: CriticType) -> torch.Tensor:
    """Where V(h) (``v``: the last prompt token) or Q(h, a) (``q``: the last token of prompt +
    response, the end token included) is read in each row of ``samples.input_ids``."""
    prompt_width = samples.input_ids.shape[1] - samples.num_completion
    if critic_type == "v":
        return torch.full((len(samples),), prompt_width - 1, device=samples.input_ids.device)
    return prompt_width - 1 + samples.completion_mask.sum(-1).clamp(min=1)


def critic_inputs(samples: AgentSamples, critic_type: CriticType) -> CriticInputs:
    """A separate critic model's view of one agent's rows (for ``v`` only the prompt: it is causal)."""
    positions = read_positions(samples, critic_type)
    end = int(positions.max()) + 1
    return CriticInputs(samples.input_ids[:, :end], samples.attention_mask[:, :end], positions)


def joint_critic_inputs(per_agent: list[AgentSamples], critic_type: CriticType, pad_id: int) -> CriticInputs:
    """The joint state of each node for a centralized critic: every agent's prompt (``v``), or
    every agent's prompt and response (``q``: the joint action), one after the other; the value is
    read at the last token."""
    ends = [read_positions(samples, critic_type) + 1 for samples in per_agent]
    rows = []
    for r in range(len(per_agent[0])):
        joint: list[int] = []
        for samples, end in zip(per_agent, ends):
            ids, mask = samples.input_ids[r, : int(end[r])], samples.attention_mask[r, : int(end[r])]
            joint += ids[mask.bool()].tolist()
        rows.append(joint)
    device = per_agent[0].input_ids.device
    input_ids, attention_mask = left_pad(rows, pad_id, device)
    positions = torch.full((len(rows),), input_ids.shape[1] - 1, device=device)
    return CriticInputs(input_ids, attention_mask, positions)


class Critic(nn.Module):
    """A value head (MLP -> tanh -> scalar) on a backbone of its own (a critic model), or on the
    actor's hidden states (``backbone`` None: the head is trained through the actor's loss)."""

    def __init__(self, hidden_size: int, backbone: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(hidden_size)

    def read(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[torch.arange(len(positions), device=hidden.device), positions])

    def forward(self, inputs: CriticInputs) -> torch.Tensor:
        mask = inputs.attention_mask
        out = self.backbone(
            input_ids=inputs.input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            output_hidden_states=True,
            logits_to_keep=1,  # only the hidden states are read
            use_cache=False,
        )
        return self.read(out.hidden_states[-1], inputs.positions)


class ActorCritic(AgentTeamModule):
    """What IAC and MAAC share; ``centralized`` says which critic they learn."""

    centralized = False

    def __init__(
        self,
        critic: Literal["head", "model"] = "head",
        critic_model: str | None = None,
        critic_type: CriticType = "v",
        critic_learning_rate: float | None = None,
        value_loss_coef: float = 0.5,
        value_clip_range: float | None = None,
        advantage_normalization: bool = True,
        policy_loss: Literal["reinforce", "ppo"] = "reinforce",
        clip_range: float = 0.2,
        ppo_epochs: int = 1,
        target_kl: float | None = None,
        entropy_coef: float = 0.0,
        logprob_reduction: Literal["sum", "mean"] = "mean",
        rollout_buffer_size: int | None = None,
        train_batch_size: int | None = None,
        **kwargs,
    ):
        """
        Args:
            critic: ``head``: a value head on each actor's last hidden state (trained with the
                actor's loss, ``critic_learning_rate`` on its own parameters); ``model``: a separate
                critic model with its own optimizer. MAAC's centralized critic is always a model.
            critic_model: Source of the critic model (default: the agent's own source); it must use
                the actors' tokenizer, as it reads their token ids.
            critic_type: ``v``: V(h) read at the last prompt token; ``q``: Q(h, a) read at the last
                token of prompt + response.
            critic_learning_rate: Learning rate of the critic (default: the actors').
            value_loss_coef: Weight of the value loss (y - V)^2.
            value_clip_range: Clip the new value to the old one +- this in the value loss; None: no clipping.
            advantage_normalization: z-score the advantages per (agent, turn) group of an update.
            policy_loss: ``reinforce``: CoMLRL's ratio-free -log pi(a) * A; ``ppo``: the clipped
                surrogate with the importance ratio against the behaviour log-probs.
            clip_range: PPO's ratio clipping epsilon (``policy_loss=ppo``).
            ppo_epochs: Passes over each update's samples (``ppo`` only; the ratio-free loss is on-policy).
            target_kl: Stop the remaining epochs of an update once an epoch's mean approximate KL to
                the behaviour policy (measured on each mini-batch's forward, before its step, as
                cleanrl does) exceeds this (``ppo`` only); None: never.
            entropy_coef: Weight of the entropy bonus on the response tokens (0: none).
            logprob_reduction: A response's loss is the ``sum`` or the ``mean`` of its tokens' terms.
            rollout_buffer_size: An update fires when each agent's buffer holds this many samples (one
                per turn of an episode); None: after every training step. The rest is used at epoch end.
            train_batch_size: Samples per mini-batch, one optimizer step each, grouped by turn and
                shuffled; None: the whole buffer in one step.
            **kwargs: The team's settings (model, num_agents, lora, learning_rate, ...): see ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        if critic not in ("head", "model"):
            raise ConfigError(f"model.critic={critic!r}: choose head (on the actor) or model (separate)")
        if critic_type not in ("v", "q"):
            raise ConfigError(
                f"model.critic_type={critic_type!r}: choose v (V(h), read at the last prompt token) or q "
                "(Q(h, a), read at the last response token)"
            )
        if self.centralized and critic == "head":
            raise ConfigError(
                "model.critic=head: the centralized critic of MAAC reads every agent's tokens and is a model of its "
                "own; set model.critic=model (or use IAC for value heads on the actors)"
            )
        if critic == "head" and critic_model is not None:
            raise ConfigError(
                f"model.critic=head puts the value head on the actor, which reads the actor's own tokens and hidden "
                f"states; model.critic_model={critic_model!r} would be unused. Drop model.critic_model or set "
                "model.critic=model"
            )
        if policy_loss not in ("reinforce", "ppo"):
            raise ConfigError(f"model.policy_loss={policy_loss!r}: choose reinforce or ppo")
        if policy_loss == "reinforce" and (ppo_epochs != 1 or target_kl is not None):
            raise ConfigError(
                "model.ppo_epochs / model.target_kl need model.policy_loss=ppo: the ratio-free loss is only "
                "correct on the samples of the current policy"
            )
        if not 0 < clip_range < 1:
            raise ConfigError(f"model.clip_range={clip_range}: must be in (0, 1)")
        if ppo_epochs < 1:
            raise ConfigError(f"model.ppo_epochs={ppo_epochs}: must be at least 1")
        if target_kl is not None and not target_kl > 0:
            raise ConfigError(f"model.target_kl={target_kl}: must be > 0 (or null)")
        if value_clip_range is not None and not value_clip_range > 0:
            raise ConfigError(f"model.value_clip_range={value_clip_range}: must be > 0 (or null)")
        if logprob_reduction not in ("sum", "mean"):
            raise ConfigError(f"model.logprob_reduction={logprob_reduction!r}: choose sum or mean")
        if entropy_coef < 0 or value_loss_coef < 0:
            raise ConfigError("model.entropy_coef and model.value_loss_coef must be >= 0")
        for name, value in (("rollout_buffer_size", rollout_buffer_size), ("train_batch_size", train_batch_size)):
            if value is not None and value < 1:
                raise ConfigError(f"model.{name}={value}: must be at least 1 (or null)")
        self.critic_kind, self.critic_source, self.critic_type = critic, critic_model, critic_type
        self.critic_learning_rate = critic_learning_rate or self.hparams.learning_rate
        self.value_loss_coef, self.value_clip_range = value_loss_coef, value_clip_range
        self.discount = 1.0  # gamma between turns: the rollout's (data.discount), read in setup
        self.advantage_normalization = advantage_normalization
        self.policy_form, self.clip_range, self.ppo_epochs = policy_loss, clip_range, ppo_epochs
        self.target_kl, self.entropy_coef, self.logprob_reduction = target_kl, entropy_coef, logprob_reduction
        self.rollout_buffer_size, self.train_batch_size = rollout_buffer_size, train_batch_size
        self.critics: nn.ModuleList | None = None
        self.rollout_buffers = [RolloutBuffer() for _ in range(self.hparams.num_agents)]

    # ------------------------------------------------------------------ models and optimizers
    def build_models(self) -> None:
        super().build_models()
        if self.critics is not None:
            return
        if self.critic_kind == "head":  # one head per learner, on its actor
            self.critics = nn.ModuleList(Critic(self.model_of(i).config.hidden_size) for i in range(len(self.learners)))
            return
        sources = [self.sources[0]] if self.centralized else [self.sources[roles[0]] for roles in self.learners]
        critics = []
        for source in sources:
            backbone, tokenizer = load_model_and_tokenizer(self.critic_source or source)
            for i, agent in enumerate(self.agents):
                if tokenizer.get_vocab() != agent.tokenizer.get_vocab():
                    raise ConfigError(
                        f"model.critic_model={self.critic_source or source!r} has another tokenizer than agent {i} "
                        f"({agent.source}): the critic reads the actors' token ids; give a critic model with the "
                        "same tokenizer"
                    )
                if not self.centralized:
                    break
            critics.append(Critic(backbone.config.hidden_size, backbone))
        self.critics = nn.ModuleList(critics)

    def model_of(self, learner: int) -> nn.Module:
        return self.agents[self.learners[learner][0]].model

    def configure_optimizers(self):
        optimizers = []
        for index, roles in enumerate(self.learners):
            groups = [{"params": self.agents[roles[0]].trainable_parameters(), "lr": self.hparams.learning_rate}]
            if self.critic_kind == "head":
                groups.append({"params": list(self.critics[index].parameters()), "lr": self.critic_learning_rate})
            optimizers.append(torch.optim.AdamW(groups, weight_decay=0.0))
        if self.critic_kind == "model":
            for critic in self.critics:
                params = [p for p in critic.parameters() if p.requires_grad]
                optimizers.append(torch.optim.AdamW(params, lr=self.critic_learning_rate, weight_decay=0.0))
        return optimizers

    def configure_callbacks(self):
        return [BufferFlush()]

    def setup(self, stage: str) -> None:
        super().setup(stage)
        from lit_marl.data import RolloutDataModule

        data = self.trainer.datamodule
        if data is None or stage != "fit":
            return
        if not isinstance(data, RolloutDataModule):
            raise ConfigError(
                f"{type(self).__name__} learns from joint rollouts: use data: lit_marl.data.RolloutDataModule"
            )
        self.discount = data.hparams.discount
        if data.num_generations > 1 and data.hparams.num_turns > 1:
            raise ConfigError(
                f"data.num_generations={data.num_generations} with data.num_turns={data.hparams.num_turns}: "
                f"{type(self).__name__} follows one trajectory per episode (its TD targets bootstrap from the next "
                "turn's state); set data.num_generations=1"
            )
        if self.centralized and data.num_generations > 1 and data.joint_mode == "cross":
            raise ConfigError(
                "data.joint_mode=cross with data.num_generations > 1: a centralized critic scores joint actions, "
                "and a response of cross mode takes part in several; use aligned or num_generations=1"
            )

    # ------------------------------------------------------------------ values, targets, advantages
    def critic_optimizer(self, critic: int):
        return self.optimizers()[len(self.learners) + critic]

    def learner_of(self, role: int) -> int:
        return next(n for n, roles in enumerate(self.learners) if role in roles)

    def actor_forward(self, learner: int, samples: AgentSamples, entropy: bool = False):
        """Completion log-probs, entropies (or None) and, for a value head, the values."""
        head = self.critic_kind == "head"
        logprobs, entropies, hidden = completion_forward(
            self.model_of(learner),
            samples.input_ids,
            samples.attention_mask,
            samples.num_completion,
            entropy=entropy,
            hidden=head,
        )
        values = self.critics[learner].read(hidden, read_positions(samples, self.critic_type)) if head else None
        return logprobs, entropies, values

    @torch.no_grad()
    def prepare(self, per_agent: list[AgentSamples]) -> tuple[list[AgentSamples], list[list[CriticInputs]]]:
        """Behaviour log-probs, values, TD targets and advantages of every row; the inputs of each
        critic model, one part per role it serves (IAC: its learner's roles; MAAC: the joint rows;
        none for value heads)."""
        next_rows, turns = self.episode_links(per_agent)
        old_logprobs, values = [], []
        for role, samples in enumerate(per_agent):
            learner = self.learner_of(role)
            parts = [self.actor_forward(learner, samples.select(rows)) for rows in self.micro_batches(samples)]
            width = samples.num_completion
            old_logprobs.append(torch.cat([torch.nn.functional.pad(p[0], (0, width - p[0].shape[1])) for p in parts]))
            if self.critic_kind == "head":
                values.append(torch.cat([p[2] for p in parts]))
        inputs: list[list[CriticInputs]] = []
        if self.centralized:
            joint = joint_critic_inputs(per_agent, self.critic_type, self.agents[0].pad_token_id)
            joint_values = torch.cat([self.critics[0](joint.select(rows)) for rows in self.micro_batches(joint)])
            targets = td_targets(team_reward(per_agent), joint_values, next_rows, self.discount)
            inputs.append([replace(joint, old_values=joint_values, targets=targets, turn_ids=turns)])
            values = [joint_values] * len(per_agent)
            all_targets = [targets] * len(per_agent)
        else:
            if self.critic_kind == "model":
                for role, samples in enumerate(per_agent):
                    view = critic_inputs(samples, self.critic_type)
                    critic = self.critics[self.learner_of(role)]
                    values.append(torch.cat([critic(view.select(rows)) for rows in self.micro_batches(view)]))
            all_targets = [td_targets(s.rewards, v, next_rows, self.discount) for s, v in zip(per_agent, values)]
            if self.critic_kind == "model":
                inputs = [
                    [
                        replace(
                            critic_inputs(per_agent[r], self.critic_type),
                            old_values=values[r],
                            targets=all_targets[r],
                            turn_ids=turns,
                        )
                        for r in roles
                    ]
                    for roles in self.learners
                ]
        prepared = [
            self.with_advantages(samples, values[role], all_targets[role], old_logprobs[role])
            for role, samples in enumerate(per_agent)
        ]
        self.log_values(prepared)
        return prepared, inputs

    def episode_links(self, per_agent: list[AgentSamples]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the row of its episode's next turn (-1: none) and its turn."""
        group_ids = per_agent[0].group_ids
        if any(not torch.equal(s.group_ids, group_ids) for s in per_agent):
            raise ValueError("the agents' buffers hold different nodes; they must be filled by the same rollouts")
        next_group = per_agent[0].next_group
        counts = torch.bincount(group_ids)
        if (next_group >= 0).any() and (counts > 1).any():
            raise ValueError("TD targets follow one trajectory: a multi-turn rollout needs data.num_generations=1")
        row_of = torch.zeros(len(counts), dtype=torch.long, device=group_ids.device)
        row_of[group_ids] = torch.arange(len(group_ids), device=group_ids.device)
        return torch.where(next_group >= 0, row_of[next_group.clamp(min=0)], -1), per_agent[0].turn_ids

    def with_advantages(
        self, samples: AgentSamples, values: torch.Tensor, targets: torch.Tensor, old_logprobs: torch.Tensor | None
    ) -> AgentSamples:
        """One role's rows with their values, TD targets, advantages (z-scored per turn if set) and
        behaviour log-probs."""
        advantages = td_advantages(targets, values, samples.turn_ids)
        if self.advantage_normalization:
            advantages = self.z_score_per_turn(advantages, samples.turn_ids)
        return replace(samples, advantages=advantages, old_logprobs=old_logprobs, old_values=values, targets=targets)

    def z_score_per_turn(self, advantages: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        """(A - mean) / std within each turn, the moments taken over the rows of every rank (one
        process with all the tasks gives the same advantages); a turn of one row is centred to 0."""
        num_turns = int(self.all_ranks_max(int(turns.max()) + 1))
        moments = torch.zeros(3, num_turns, dtype=torch.float64, device=advantages.device)
        moments[0].index_add_(0, turns, torch.ones_like(advantages, dtype=torch.float64))
        moments[1].index_add_(0, turns, advantages.double())
        moments[2].index_add_(0, turns, advantages.double() ** 2)
        if self.world_size > 1:
            torch.distributed.all_reduce(moments)
        count = moments[0].clamp(min=1)
        mean = moments[1] / count
        var = (moments[2] / count - mean**2).clamp(min=0)
        return ((advantages - mean[turns]) / (var[turns].sqrt() + 1e-6)).float()

    def log_values(self, per_agent: list[AgentSamples]) -> None:
        """Per turn and agent: value mean, explained variance of the targets, advantage mean and std."""
        for role, samples in enumerate(per_agent):
            for turn in torch.unique(samples.turn_ids).tolist():
                rows = samples.turn_ids == turn
                count = int(rows.sum())
                v, y, a = samples.old_values[rows], samples.targets[rows], samples.advantages[rows]
                if not self.centralized or role == 0:  # a centralized critic's values once
                    name = "critic" if self.centralized else f"agent{role}"
                    self.log(f"train/turn{turn}/value_mean_{name}", v.mean(), batch_size=count)
                    explained = 1 - (y - v).var(unbiased=False) / y.var(unbiased=False).clamp(min=1e-8)
                    self.log(f"train/turn{turn}/explained_variance_{name}", explained, batch_size=count)
                self.log(f"train/turn{turn}/advantage_mean_agent{role}", a.mean(), batch_size=count)
                self.log(f"train/turn{turn}/advantage_std_agent{role}", a.std(unbiased=False), batch_size=count)

    # ------------------------------------------------------------------ losses
    def actor_loss(self, learner: int, samples: AgentSamples, stats: dict, forward=None) -> torch.Tensor:
        """Summed over rows: the policy term of each response (its tokens' sum or mean), minus the
        entropy bonus, plus for a value head the weighted value loss. ``forward``: the outputs of
        ``actor_forward`` on ``samples`` when already run."""
        if forward is None:
            forward = self.actor_forward(learner, samples, entropy=self.entropy_coef > 0)
        logprobs, entropies, values = forward
        mask = samples.completion_mask.float()
        advantages = samples.advantages.unsqueeze(1)
        if self.policy_form == "ppo":
            ratio = (logprobs - samples.old_logprobs).exp()
            clipped = ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
            per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        else:
            per_token = -logprobs * advantages
        if entropies is not None:
            per_token = per_token - self.entropy_coef * entropies
        per_row = (per_token * mask).sum(-1)
        if self.logprob_reduction == "mean":
            per_row = per_row / mask.sum(-1).clamp(min=1)
        loss = per_row.sum()
        if values is not None:
            loss = loss + self.value_term(values, samples.old_values, samples.targets)
        with torch.no_grad():
            log_ratio = logprobs - samples.old_logprobs
            for turn in torch.unique(samples.turn_ids).tolist():
                rows = (samples.turn_ids == turn).float().unsqueeze(1) * mask
                stat = stats.setdefault(turn, dict.fromkeys(("approx_kl", "clip_frac", "entropy", "tokens"), 0.0))
                stat["approx_kl"] += float(((log_ratio.exp() - 1 - log_ratio) * rows).sum())
                stat["clip_frac"] += float((((log_ratio.exp() - 1).abs() > self.clip_range).float() * rows).sum())
                if entropies is not None:
                    stat["entropy"] += float((entropies * rows).sum())
                stat["tokens"] += float(rows.sum())
        return loss

    def value_term(self, values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """value_loss_coef x the (clipped) squared error, summed over rows."""
        ones = torch.ones_like(values)
        return self.value_loss_coef * value_loss(values, old_values, targets, ones, self.value_clip_range) * len(values)

    def critic_loss(self, critic: int, inputs: CriticInputs) -> torch.Tensor:
        return self.value_term(self.critics[critic](inputs), inputs.old_values, inputs.targets)

    # ------------------------------------------------------------------ the step
    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self.buffer_step(batch, batch.agents)  # advantages come at the update, from the critic of that moment

    def flush_buffers(self) -> None:
        """One update on everything buffered: actors, then critics, on the same mini-batches."""
        # every rank adds its episodes each step, so all ranks hold samples here or none does
        if not self.all_ranks_max(len(self.rollout_buffers[0])):
            return
        with Timer() as train_time:
            drained = [buffer.drain(agent.pad_token_id) for buffer, agent in zip(self.rollout_buffers, self.agents)]
            size = len(drained[0])
            result = self.update_in_one_pass(drained)
            if result is None:
                result = self.update_in_minibatches(*self.prepare(drained))
            actor_losses, critic_losses, epochs = result
        for index, losses in actor_losses.items():
            name = self.learner_name(index)
            self.log(f"train/loss_{name}", sum(losses) / len(losses), batch_size=size)
            self.log(f"train/optimizer_steps_{name}", float(len(losses)), batch_size=size)
        for c, losses in critic_losses.items():
            name = "critic" if self.centralized else f"critic_{self.learner_name(c)}"
            self.log(f"train/loss_{name}", sum(losses) / len(losses), batch_size=size)
            self.log(f"train/optimizer_steps_{name}", float(len(losses)), batch_size=size)
        self.log("train/ppo_epochs_run", float(epochs), batch_size=size)
        self.log("time/train_s", train_time.seconds)

    def update_in_minibatches(
        self, per_agent: list[AgentSamples], inputs: list[list[CriticInputs]]
    ) -> tuple[dict, dict, int]:
        """``ppo_epochs`` passes over the prepared rows, one optimizer step per model and mini-batch
        (actors, then critics); the epochs stop early past ``target_kl``. Returns the actor and critic
        losses and the epochs run."""
        actor_losses: dict[int, list[float]] = {i: [] for i in range(len(self.learners))}
        critic_losses: dict[int, list[float]] = {i: [] for i in range(len(inputs))}
        epochs = 0
        for _ in range(self.ppo_epochs):
            stats: dict[int, dict[str, float]] = {}
            batches = minibatches(per_agent[0], self.train_batch_size, self.shuffle_generator)
            for rows in self.synced_steps(batches):  # trees of other ranks may be longer
                for index, roles in enumerate(self.learners):
                    agent = self.agents[roles[0]]
                    mini = None
                    if rows is not None:
                        mini = AgentSamples.cat([per_agent[r].select(rows) for r in roles], agent.pad_token_id)
                    loss_fn = lambda mb, i=index, s=stats: self.actor_loss(i, mb, s)  # noqa: E731
                    actor_losses[index].append(self.update_agent(index, mini, loss_fn))
                for c, parts in enumerate(inputs):
                    name = "critic" if self.centralized else f"critic_{self.learner_name(c)}"
                    mini = None
                    if rows is not None:
                        mini = CriticInputs.cat([part.select(rows) for part in parts], self.agents[0].pad_token_id)
                    loss_fn = lambda mb, c=c: self.critic_loss(c, mb)  # noqa: E731
                    critic_losses[c].append(self.optimizer_step_on(self.critic_optimizer(c), mini, loss_fn, name))
            epochs += 1
            self.log_policy_stats(stats)
            if self.target_kl is not None:
                # the KL over every rank's tokens: one decision, so all ranks take the same steps
                tokens = self.all_ranks_sum(sum(s["tokens"] for s in stats.values()))
                kl = self.all_ranks_sum(sum(s["approx_kl"] for s in stats.values())) / max(tokens, 1.0)
                if kl > self.target_kl:
                    break
        return actor_losses, critic_losses, epochs

    def update_in_one_pass(self, per_agent: list[AgentSamples]) -> tuple[dict, dict, int] | None:
        """The update in one forward per model, when it is one optimizer step per model on rows that
        fit one forward/backward pass (``ppo_epochs`` 1, one mini-batch; decided over all ranks):
        the behaviour log-probs and values are then those of the update's own forward (the ratio is
        1), so ``prepare``'s no-grad pass over the same rows and weights is skipped. Same values,
        targets, advantages and gradients as ``prepare`` and the mini-batch loop. Returns the
        actor and critic losses and the epochs run (1), or None: the caller takes the two-pass path."""
        if self.ppo_epochs != 1 or self.train_batch_size is not None:
            return None
        pad = self.agents[0].pad_token_id
        minis = []
        for roles in self.learners:
            mini = AgentSamples.cat([per_agent[r] for r in roles], self.agents[roles[0]].pad_token_id)
            minis.append(mini.select(torch.arange(len(mini), device=mini.input_ids.device)))
        critic_minis: list[CriticInputs] = []
        if self.centralized:
            critic_minis = [joint_critic_inputs(per_agent, self.critic_type, pad)]
        elif self.critic_kind == "model":
            critic_minis = [
                CriticInputs.cat([critic_inputs(per_agent[r], self.critic_type) for r in roles], pad)
                for roles in self.learners
            ]
        fits = all(len(self.micro_batches(m)) == 1 for m in minis + critic_minis)
        if self.all_ranks_max(0.0 if fits else 1.0) > 0:
            return None
        next_rows, turns = self.episode_links(per_agent)
        values: list[torch.Tensor | None] = [None] * len(per_agent)
        targets: list[torch.Tensor | None] = [None] * len(per_agent)

        def learner_values(roles: list[int], learned: torch.Tensor) -> None:
            """A learner's values (detached), split by the roles it plays, and each role's TD targets."""
            for r, v in zip(roles, learned.detach().split([len(per_agent[r]) for r in roles])):
                values[r], targets[r] = v, td_targets(per_agent[r].rewards, v, next_rows, self.discount)

        critic_values = [critic(m) for critic, m in zip(self.critics, critic_minis)]  # kept for their step
        if self.centralized:
            joint_values = critic_values[0].detach()
            values = [joint_values] * len(per_agent)
            targets = [td_targets(team_reward(per_agent), joint_values, next_rows, self.discount)] * len(per_agent)
        elif self.critic_kind == "model":
            for roles, learned in zip(self.learners, critic_values):
                learner_values(roles, learned)
        for c, (m, roles) in enumerate(zip(critic_minis, [[0]] if self.centralized else self.learners)):
            critic_minis[c] = replace(
                m,
                old_values=critic_values[c].detach(),
                targets=torch.cat([targets[r] for r in roles]),
                turn_ids=turns.repeat(len(roles)),
            )
        prepared: list[AgentSamples | None] = [None] * len(per_agent)
        actor_losses, stats = {}, {}
        for index, roles in enumerate(self.learners):
            forward = self.actor_forward(index, minis[index], entropy=self.entropy_coef > 0)
            if self.critic_kind == "head":
                learner_values(roles, forward[2])
            for r in roles:
                prepared[r] = self.with_advantages(per_agent[r], values[r], targets[r], None)
            mini = replace(
                minis[index],
                advantages=torch.cat([prepared[r].advantages for r in roles]),
                old_logprobs=forward[0].detach(),
                old_values=torch.cat([values[r] for r in roles]),
                targets=torch.cat([targets[r] for r in roles]),
            )
            loss = self.actor_loss(index, mini, stats, forward=forward)
            actor_losses[index] = [self.update_agent(index, mini, lambda rows, loss=loss: loss)]
        critic_losses = {}
        for c, (m, v) in enumerate(zip(critic_minis, critic_values)):
            name = "critic" if self.centralized else f"critic_{self.learner_name(c)}"
            loss = self.value_term(v, m.old_values, m.targets)
            critic_losses[c] = [self.optimizer_step_on(self.critic_optimizer(c), m, lambda rows, loss=loss: loss, name)]
        self.log_values(prepared)
        self.log_policy_stats(stats)
        return actor_losses, critic_losses, 1

    def log_policy_stats(self, stats: dict[int, dict[str, float]]) -> None:
        """Per turn, over the last epoch's tokens: approximate KL to the behaviour policy (measured
        before each mini-batch's step), clip fraction, entropy."""
        for turn, stat in stats.items():
            tokens = max(stat["tokens"], 1.0)
            self.log(f"train/turn{turn}/approx_kl", stat["approx_kl"] / tokens)
            self.log(f"train/turn{turn}/clip_frac", stat["clip_frac"] / tokens)
            if self.entropy_coef > 0:
                self.log(f"train/turn{turn}/entropy", stat["entropy"] / tokens)


class IAC(ActorCritic):
    """Independent actor-critic: each agent learns its own critic from its own reward (a value
    head on its actor, or a critic model). With ``policy_loss=ppo``: IPPO."""

    def __init__(self, critic: Literal["head", "model"] = "head", **kwargs):
        """
        Args:
            critic: ``head``: a value head on each actor; ``model``: a critic model per agent.
            **kwargs: See ``ActorCritic``.
        """
        super().__init__(critic=critic, **kwargs)


class MAAC(ActorCritic):
    """Multi-agent actor-critic with one centralized critic over the joint state (and, for
    ``critic_type=q``, the joint action), trained once per mini-batch - not once per agent - on the
    team reward; every agent's advantage comes from it. With ``policy_loss=ppo``: MAPPO."""

    centralized = True

    def __init__(self, critic: Literal["model"] = "model", **kwargs):
        """
        Args:
            critic: Always ``model``: the centralized critic reads every agent's tokens.
            **kwargs: See ``ActorCritic``.
        """
        super().__init__(critic=critic, **kwargs)
