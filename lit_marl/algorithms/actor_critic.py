"""Actor-critic on single-trajectory episodes: IAC (a critic per agent) and MAAC (one centralized
critic over the joint state).

The rollout is the joint tree with one response per agent and node (``data.num_generations=1``):
one joint trajectory per task, each turn's node linked to the next by ``next_group``. At an update
every row (one agent's turn) gets the one-step TD target y = r + gamma * V(h_next), gamma being
``model.discount``, with no bootstrap after the final or an early-terminated turn, and the advantage
A = y - V(h), optionally z-scored per (agent, turn). The actor's loss is CoMLRL's ratio-free
-log pi(a) * A, or the clipped PPO surrogate against the behaviour log-probs over several epochs,
with an entropy bonus and a ``target_kl`` stop: with per-agent value heads that is IPPO, with the
centralized critic MAPPO.

One update path: a forward over every row of the update gives the behaviour log-probs and values,
hence targets and advantages, then ``ppo_epochs`` passes over mini-batches take the optimizer
steps. When the update is one step per model on rows that fit one pass, that forward keeps its
graph and is the step's own (its outputs detached for the targets: the ratio is 1); otherwise it
runs without gradients (``prepare``) and each mini-batch runs its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.algorithms.critics import (
    Critic,
    CriticInputs,
    critic_inputs,
    joint_critic_inputs,
    load_critic_backbone,
    read_positions,
)
from lit_marl.algorithms.settings import (
    BUFFER_FIELDS,
    AdvantageSettings,
    BufferSettings,
    CriticSettings,
    UpdateSettings,
    logit_temperature,
    read_groups,
)
from lit_marl.fields import check_fields
from lit_marl.logprobs import completion_forward
from lit_marl.losses import (
    clip_fraction,
    clipped_surrogate,
    explained_variance,
    k3_kl,
    masked_sum,
    reinforce,
    value_loss,
)
from lit_marl.metrics import Timer, rollout_correction
from lit_marl.models import checkpointed_passes, set_attention
from lit_marl.parallel.collectives import all_ranks_max, all_ranks_sum, padded_steps, z_score_per_group
from lit_marl.returns import next_turn_rows, td_advantages, td_targets, team_reward
from lit_marl.rollout.batch import AgentSamples, RolloutBatch
from lit_marl.rollout.buffer import batch_turns, minibatches

Forward = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""An actor's completion log-probs, entropies (or None) and value-head values (or None)."""


@dataclass
class _UpdateSamples:
    """The rows of one update: each learner's (its roles' rows, one block per role) and each
    critic model's inputs (IAC: its learner's roles; MAAC: the joint state of every node)."""

    actors: list[AgentSamples]
    critics: list[CriticInputs]


class ActorCritic(AgentTeamModule):
    """What IAC and MAAC share; ``centralized`` says which critic they learn."""

    buffered = True

    centralized = False
    critic_reward: Literal["team", "per_agent"] = "team"
    """MAAC's TD targets: of the team reward (the mean over agents), or each agent's own (CoMLRL)."""
    critic_updates: Literal["once", "per_agent"] = "once"
    """MAAC's critic steps per mini-batch: once, or once per agent on its targets (CoMLRL)."""

    def __init__(
        self,
        critic: CriticSettings = CriticSettings(),
        advantage: AdvantageSettings = AdvantageSettings(),
        policy_loss: Literal["reinforce", "ppo"] = "reinforce",
        update: UpdateSettings = UpdateSettings(),
        buffer: BufferSettings = BufferSettings(),
        **kwargs,
    ):
        """
        Args:
            critic: The critic (``algorithms.settings.CriticSettings``): a value ``head`` on each actor or a
                critic ``model`` (MAAC's centralized critic always is one), its ``type`` (``v``: V(h) at the last
                prompt token; ``q``: Q(h, a) at the last token of prompt + response), learning rate, value loss
                weight and clipping. IAC/MAAC read every field but ``warmup``.
            advantage: How TD errors become advantages (``algorithms.settings.AdvantageSettings``): IAC/MAAC read
                ``normalization`` (z-scored per (agent, turn) group of an update).
            policy_loss: ``reinforce``: CoMLRL's ratio-free -log pi(a) * A; ``ppo``: the clipped
                surrogate with the importance ratio against the behaviour log-probs.
            update: How the buffered samples become optimizer steps (``algorithms.settings.UpdateSettings``):
                IAC/MAAC read ``ppo_epochs``, ``clip_range`` and ``target_kl`` (``policy_loss: ppo``),
                ``entropy_coef``, ``logprob_reduction``, ``train_batch_size`` (groups: one turn of one episode)
                and ``rollout_is_cap``.
            buffer: When an update fires and in which order (``algorithms.settings.BufferSettings``).
            **kwargs: The team's settings (model, num_agents, lora, learning_rate, ...): see ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        check_fields("model", ActorCritic.__init__, locals())
        groups = {"update": self.update_fields, "buffer": BUFFER_FIELDS, "critic": self.critic_fields}
        given = {"update": (UpdateSettings, update), "buffer": (BufferSettings, buffer)}
        given |= {"critic": (CriticSettings, critic), "advantage": (AdvantageSettings, advantage)}
        read_groups(self, groups | {"advantage": self.advantage_fields}, **given)
        kind = self.critic.kind or ("model" if self.centralized else "head")
        if self.centralized and kind == "head":
            raise ConfigError(
                "model.critic.kind=head: the centralized critic of MAAC reads every agent's tokens and is a model of "
                "its own; leave model.critic.kind out (or use IAC for value heads on the actors)"
            )
        if kind == "head" and self.critic.model is not None:
            raise ConfigError(
                f"model.critic.kind=head puts the value head on the actor, which reads the actor's own tokens and "
                f"hidden states; model.critic.model={self.critic.model!r} would be unused. Drop model.critic.model "
                "or set model.critic.kind=model"
            )
        if policy_loss == "reinforce" and (self.update.ppo_epochs != 1 or self.update.target_kl is not None):
            raise ConfigError(
                "model.update.ppo_epochs / model.update.target_kl need model.policy_loss=ppo: the ratio-free loss is "
                "only correct on the samples of the current policy"
            )
        self.critic_kind = kind
        self.critic_learning_rate = self.critic.learning_rate or self.hparams.learning_rate
        self.policy_form = policy_loss
        self.critics: nn.ModuleList | None = None

    update_fields = frozenset(
        {"ppo_epochs", "train_batch_size", "clip_range", "target_kl", "entropy_coef", "logprob_reduction"}
        | {"rollout_is_cap", "tempered_logprobs"}
    )
    """The ``model.update`` fields IAC/MAAC read."""
    advantage_fields = frozenset({"normalization"})
    """The ``model.advantage`` fields IAC/MAAC read."""
    logit_temperature = 1.0
    """What the update divides the logits by before scoring (``model.update.tempered_logprobs``), set in ``setup``."""
    critic_fields = frozenset({"kind", "model", "type", "learning_rate", "value_loss_coef", "value_clip_range"})
    """The ``model.critic`` fields IAC/MAAC read."""

    # ------------------------------------------------------------------ models and optimizers
    def build_models(self) -> None:
        super().build_models()
        if self.critics is not None:
            return
        if self.critic_kind == "head":  # one head per learner, on its actor
            self.critics = nn.ModuleList(Critic(self.model_of(i).config.hidden_size) for i in range(len(self.learners)))
            return
        sources = [self.sources[0]] if self.centralized else [self.sources[roles[0]] for roles in self.learners]
        readers = list(self.agents) if self.centralized else self.agents[:1]
        critics = []
        for source in sources:
            backbone = load_critic_backbone(self.critic.model or source, readers)
            set_attention([backbone], self.attn_implementation)
            critics.append(Critic(backbone.config.hidden_size, backbone))
        self.critics = nn.ModuleList(critics)

    def configure_optimizers(self):
        optimizers = []
        for index, roles in enumerate(self.learners):
            policy = self.agents[roles[0]].trainable_parameters()
            groups = [{"params": policy, "lr": self.hparams.learning_rate, "role": "policy"}]
            if self.critic_kind == "head":
                critic = list(self.critics[index].parameters())
                groups.append({"params": critic, "lr": self.critic_learning_rate, "role": "critic"})
            optimizers.append(torch.optim.AdamW(groups, weight_decay=self.weight_decay))
        if self.critic_kind == "model":
            for critic in self.critics:
                params = [p for p in critic.parameters() if p.requires_grad]
                optimizers.append(
                    torch.optim.AdamW(
                        [{"params": params, "role": "critic"}],
                        lr=self.critic_learning_rate,
                        weight_decay=self.weight_decay,
                    )
                )
        return optimizers

    def setup(self, stage: str) -> None:
        super().setup(stage)
        rollout = self.rollout_settings
        self.logit_temperature = logit_temperature(self.update, rollout)
        if rollout is None or stage != "fit":
            return
        rollout.require("tree", type(self).__name__)
        tree = rollout.tree
        if tree.num_generations > 1 and tree.num_turns > 1:
            raise ConfigError(
                f"data.num_generations={tree.num_generations} with data.num_turns={tree.num_turns}: "
                f"{type(self).__name__} follows one trajectory per episode (its TD targets bootstrap from the next "
                "turn's state); set data.num_generations=1"
            )
        if self.centralized and tree.num_generations > 1 and tree.joint_mode == "cross":
            raise ConfigError(
                "data.joint_mode=cross with data.num_generations > 1: a centralized critic scores joint actions, "
                "and a response of cross mode takes part in several; use aligned or num_generations=1"
            )

    def critic_optimizer(self, critic: int):
        return self.optimizers()[len(self.learners) + (0 if self.centralized else critic)]

    def critic_roles(self) -> list[list[int]]:
        """The roles whose targets each critic step of a mini-batch learns (IAC: each critic model's
        learner's roles; MAAC: the joint rows, once, or once per agent on its own targets)."""
        if self.critic_kind == "head":
            return []
        if self.centralized:
            roles = list(range(self.hparams.num_agents))
            if self.critic_updates == "per_agent":
                return [[r] for r in roles]
            return [roles] if self.critic_reward == "per_agent" else [[0]]  # one step on every agent's targets
        return self.learners

    def critic_model(self, entry: int) -> nn.Module:
        """The critic model of a ``critic_roles`` entry (MAAC: always its one critic)."""
        return self.critics[0 if self.centralized else entry]

    # ------------------------------------------------------------------ forwards
    def actor_forward(self, learner: int, samples: AgentSamples, entropy: bool = False) -> Forward:
        """Completion log-probs, entropies (or None) and, for a value head, the values."""
        head = self.critic_kind == "head"
        logprobs, entropies, hidden = completion_forward(
            self.model_of(learner),
            samples.input_ids,
            samples.attention_mask,
            samples.num_completion,
            entropy=entropy,
            hidden=head,
            temperature=self.logit_temperature,
        )
        values = self.critics[learner].read(hidden, read_positions(samples, self.critic.type)) if head else None
        return logprobs, entropies, values

    def update_rows(self, per_agent: list[AgentSamples]) -> _UpdateSamples:
        """Each learner's rows (its roles' blocks, trimmed) and each critic model's inputs."""
        pad = self.agents[0].pad_token_id
        actors = []
        for roles in self.learners:
            rows = AgentSamples.cat([per_agent[r] for r in roles], self.agents[roles[0]].pad_token_id)
            actors.append(rows.select(torch.arange(len(rows), device=rows.input_ids.device)))
        if self.critic_kind == "head":
            return _UpdateSamples(actors, [])
        if self.centralized:  # the joint rows once per role whose targets a critic step learns
            joint = joint_critic_inputs(per_agent, self.critic.type, pad)
            return _UpdateSamples(
                actors, [CriticInputs.cat([joint] * len(roles), pad) for roles in self.critic_roles()]
            )
        critics = [
            CriticInputs.cat([critic_inputs(per_agent[r], self.critic.type) for r in roles], pad)
            for roles in self.learners
        ]
        return _UpdateSamples(actors, critics)

    def forwards(self, rows: _UpdateSamples) -> tuple[list[Forward], list[torch.Tensor]]:
        """Every actor's and critic model's outputs on the update's rows, in the passes of
        ``micro_batches`` (one pass each when the graph is kept)."""
        entropy = torch.is_grad_enabled() and self.update.entropy_coef > 0
        actors = []
        for learner, samples in enumerate(rows.actors):
            chunks = self.passes(samples, [self.model_of(learner)])
            parts = [self.actor_forward(learner, samples.select(r), entropy) for r in chunks]
            width = samples.num_completion
            logprobs = torch.cat([nn.functional.pad(p[0], (0, width - p[0].shape[1])) for p in parts])
            entropies = torch.cat([p[1] for p in parts]) if entropy else None
            values = torch.cat([p[2] for p in parts]) if self.critic_kind == "head" else None
            actors.append((logprobs, entropies, values))
        computed: dict[int, torch.Tensor] = {}  # MAAC stepping once per agent: the same joint rows, run once
        for c, inputs in enumerate(rows.critics):
            if id(inputs) not in computed:
                chunks = self.passes(inputs, [self.critic_model(c)])
                computed[id(inputs)] = torch.cat([self.critic_model(c)(inputs.select(r)) for r in chunks])
        return actors, [computed[id(inputs)] for inputs in rows.critics]

    @torch.no_grad()
    def prepare(self, rows: _UpdateSamples) -> tuple[list[Forward], list[torch.Tensor]]:
        """The behaviour pass of an update of several steps: ``forwards`` without gradients."""
        return self.forwards(rows)

    def fits_one_pass(self, rows: _UpdateSamples) -> bool:
        """One optimizer step per model (``ppo_epochs`` 1, one mini-batch) on rows that fit one
        forward/backward pass, on every rank."""
        if self.update.ppo_epochs != 1 or self.update.train_batch_size is not None or self.buffer.schedule != "joint":
            return False
        if len(rows.critics) > len(self.critics or []):  # a critic stepping once per agent
            return False
        fits = all(len(self.micro_batches(m)) == 1 for m in rows.actors + rows.critics)
        return all_ranks_max(0.0 if fits else 1.0, self.device) == 0

    # ------------------------------------------------------------------ values, targets, advantages
    def with_targets(
        self, per_agent: list[AgentSamples], rows: _UpdateSamples, forwards
    ) -> tuple[_UpdateSamples, list[AgentSamples]]:
        """The rows with their behaviour log-probs, values, TD targets and advantages (all detached);
        and each role's rows with its values, targets and advantages (for the logs)."""
        actor_out, critic_values = forwards
        if any(not torch.equal(s.group_ids, per_agent[0].group_ids) for s in per_agent):
            raise ValueError("the agents' buffers hold different nodes; they must be filled by the same rollouts")
        next_rows, turns = next_turn_rows(per_agent[0].group_ids, per_agent[0].next_group), per_agent[0].turn_ids
        values: list[torch.Tensor] = [None] * len(per_agent)
        if self.centralized:  # one value per node, every agent's; targets of the team reward or each agent's
            values = [critic_values[0].detach()[: len(per_agent[0])]] * len(per_agent)  # the first copy of the nodes
            if self.critic_reward == "team":
                team = td_targets(team_reward([s.rewards for s in per_agent]), values[0], next_rows, self.discount)
                targets = [team] * len(per_agent)
            else:
                targets = [td_targets(s.rewards, values[0], next_rows, self.discount) for s in per_agent]
        else:
            learned = critic_values if self.critic_kind == "model" else [out[2] for out in actor_out]
            for roles, v in zip(self.learners, learned):
                for r, part in zip(roles, v.detach().split([len(per_agent[r]) for r in roles])):
                    values[r] = part
            targets = [td_targets(s.rewards, v, next_rows, self.discount) for s, v in zip(per_agent, values)]
        per_role = [self.advantages(replace(s, old_values=v, targets=t)) for s, v, t in zip(per_agent, values, targets)]
        actors = [
            replace(
                samples,
                advantages=torch.cat([per_role[r].advantages for r in roles]),
                old_logprobs=out[0].detach(),
                old_values=torch.cat([values[r] for r in roles]),
                targets=torch.cat([targets[r] for r in roles]),
            )
            for samples, roles, out in zip(rows.actors, self.learners, actor_out)
        ]
        critics = [
            replace(
                inputs,
                old_values=v.detach(),
                targets=torch.cat([targets[r] for r in roles]),
                turn_ids=turns.repeat(len(roles)),
            )
            for inputs, v, roles in zip(rows.critics, critic_values, self.critic_roles())
        ]
        return _UpdateSamples(actors, critics), per_role

    def advantages(self, samples: AgentSamples) -> AgentSamples:
        """``samples`` with A = y - V(h) (their ``targets`` and ``old_values``), z-scored within each
        turn over every rank's rows if set (a turn of one row keeps its raw advantage)."""
        advantages = td_advantages(samples.targets, samples.old_values)
        if self.advantage.normalized():
            advantages = z_score_per_group(advantages, samples.turn_ids)
        return samples.with_advantages(advantages)

    def log_values(self, per_agent: list[AgentSamples]) -> None:
        """Per turn and agent: value mean, explained variance of the targets, advantage mean and std."""
        for role, samples in enumerate(per_agent):
            for turn in torch.unique(samples.turn_ids).tolist():
                rows = samples.turn_ids == turn
                count = int(rows.sum())
                v, y, a = samples.old_values[rows], samples.targets[rows], samples.advantages[rows]
                if not self.centralized or role == 0:  # a centralized critic's values once
                    name = "critic" if self.centralized else f"agent{role}"
                    values = {"value_mean": v.mean(), "explained_variance": explained_variance(y, v)}
                    self.record({f"{name}/turn_{turn}/{key}": value for key, value in values.items()}, count)
                advantage = {"advantage_mean": a.mean(), "advantage_std": a.std(unbiased=False)}
                self.record({f"agent{role}/turn_{turn}/{key}": value for key, value in advantage.items()}, count)
            self.step_log.distribution(f"agent{role}/advantage", samples.advantages)

    # ------------------------------------------------------------------ losses
    def loss(self, samples: AgentSamples, stats: dict, learner: int, forward: Forward | None = None):
        """Learner ``learner``'s actor loss on ``samples``, summed over rows: the policy term of each
        response (its tokens' sum or mean), minus the entropy bonus, plus for a value head the
        weighted value loss. ``forward``: the outputs of ``actor_forward`` on ``samples`` when
        already run."""
        if forward is None:
            forward = self.actor_forward(learner, samples, entropy=self.update.entropy_coef > 0)
        logprobs, entropies, values = forward
        mask = samples.completion_mask.float()
        advantages = samples.advantages.unsqueeze(1)
        if self.policy_form == "ppo":
            per_token = clipped_surrogate(logprobs, samples.old_logprobs, advantages, self.update.clip_range)
        else:
            per_token = reinforce(logprobs, advantages)
        weights = rollout_correction(
            self.step_log, samples.old_logprobs, samples, mask, self.update.rollout_is_cap, self.logit_temperature
        )
        per_token = per_token if weights is None else per_token * weights  # truncated importance sampling
        if entropies is not None:
            per_token = per_token - self.update.entropy_coef * entropies
        loss = masked_sum(per_token, mask, self.update.logprob_reduction).sum()
        if values is not None:
            loss = loss + self.value_term(values, samples.old_values, samples.targets)
        with torch.no_grad():
            log_ratio = logprobs - samples.old_logprobs
            for turn in torch.unique(samples.turn_ids).tolist():
                rows = (samples.turn_ids == turn).float().unsqueeze(1) * mask
                stat = stats.setdefault(turn, dict.fromkeys(("approx_kl", "clip_frac", "entropy", "tokens"), 0.0))
                stat["approx_kl"] += float((k3_kl(log_ratio) * rows).sum())
                stat["clip_frac"] += float((clip_fraction(log_ratio, self.update.clip_range) * rows).sum())
                if entropies is not None:
                    stat["entropy"] += float((entropies * rows).sum())
                stat["tokens"] += float(rows.sum())
        return loss

    def value_term(self, values: torch.Tensor, old_values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """value_loss_coef x the (clipped) squared error, summed over rows."""
        ones = torch.ones_like(values)
        return self.critic.value_loss_coef * value_loss(
            values, old_values, targets, ones, self.critic.value_clip_range, "sum"
        )

    def critic_loss(self, critic: int, inputs: CriticInputs, values: torch.Tensor | None = None) -> torch.Tensor:
        values = self.critic_model(critic)(inputs) if values is None else values
        return self.value_term(values, inputs.old_values, inputs.targets)

    # ------------------------------------------------------------------ the step
    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self.buffer_step(batch, batch.agents)  # advantages come at the update, from the critic of that moment

    def flush_buffers(self) -> None:
        """One update on everything buffered: actors, then critics, on the same mini-batches."""
        # every rank adds its episodes each step, so all ranks hold samples here or none does
        if not all_ranks_max(len(self.rollout_buffers[0]), self.device):
            return
        with Timer() as train_time:
            drained = [buffer.drain(agent.pad_token_id) for buffer, agent in zip(self.rollout_buffers, self.agents)]
            actor_losses, critic_losses, epochs = self.train_on(drained)
        # the losses are over every rank's rows already; the steps and epochs are the same on every rank
        by_learner = {self.learner_name(index): losses for index, losses in actor_losses.items()}
        for c, losses in critic_losses.items():  # MAAC stepping once per agent: one critic's steps together
            by_learner.setdefault(self.critic_name(c), []).extend(losses)
        for name, losses in by_learner.items():
            self.record({f"{name}/loss": sum(losses) / len(losses), f"{name}/optimizer_steps": len(losses)})
        actor = [loss for losses in actor_losses.values() for loss in losses]
        self.record({"train/loss": sum(actor) / len(actor), "train/ppo_epochs_run": epochs})
        self.record({"perf/train_s": train_time.seconds})

    def critic_name(self, critic: int) -> str:
        return "critic" if self.centralized else f"critic_{self.learner_name(critic)}"

    def train_on(self, per_agent: list[AgentSamples]) -> tuple[dict, dict, int]:
        """``ppo_epochs`` passes over the update's rows, one optimizer step per model and mini-batch
        (actors, then critics); the epochs stop early past ``target_kl``. Returns the actor and critic
        losses and the epochs run."""
        rows = self.update_rows(per_agent)
        one_pass = self.fits_one_pass(rows)
        with checkpointed_passes(self):  # the one-pass forwards build the graph the later backwards use
            forwards = self.forwards(rows) if one_pass else self.prepare(rows)
        rows, per_role = self.with_targets(per_agent, rows, forwards)
        self.log_values(per_role)
        cached_actors, cached_critics = (
            forwards if one_pass else ([None] * len(rows.actors), [None] * len(rows.critics))
        )
        actor_losses: dict[int, list[float]] = {i: [] for i in range(len(self.learners))}
        critic_losses: dict[int, list[float]] = {i: [] for i in range(len(rows.critics))}
        epochs = 0
        for _ in range(self.update.ppo_epochs):
            stats: dict[int, dict[str, float]] = {}
            batches = minibatches(
                per_agent[0], self.update.train_batch_size, self.shuffle_generator, self.buffer.schedule
            )
            for picked in padded_steps(batches, self.device, batch_turns(per_agent[0], batches, self.buffer.schedule)):
                for index, roles in enumerate(self.learners):
                    mini = (
                        None if picked is None else rows.actors[index].select(self.of_roles(picked, roles, per_agent))
                    )
                    loss_fn = lambda mb, i=index, s=stats, f=cached_actors[index]: self.loss(mb, s, i, f)  # noqa: E731
                    actor_losses[index].append(self.update_agent(index, mini, loss_fn))
                for c, roles in enumerate(self.critic_roles()):
                    mini = None if picked is None else rows.critics[c].select(self.of_roles(picked, roles, per_agent))
                    loss_fn = lambda mb, c=c, v=cached_critics[c]: self.critic_loss(c, mb, v)  # noqa: E731
                    step = self.optimizer_step_on(self.critic_optimizer(c), mini, loss_fn, self.critic_name(c))
                    critic_losses[c].append(step)
            epochs += 1
            self.log_policy_stats(stats)
            if self.update.target_kl is not None:
                # the KL over every rank's tokens: one decision, so all ranks take the same steps
                tokens = all_ranks_sum(sum(s["tokens"] for s in stats.values()), self.device)
                kl = all_ranks_sum(sum(s["approx_kl"] for s in stats.values()), self.device) / max(tokens, 1.0)
                if kl > self.update.target_kl:
                    break
        return actor_losses, critic_losses, epochs

    @staticmethod
    def of_roles(picked: torch.Tensor, roles: list[int], per_agent: list[AgentSamples]) -> torch.Tensor:
        """A mini-batch's rows (indices into one role's rows) in rows that hold several roles' rows, one block each."""
        return torch.cat([picked + k * len(per_agent[0]) for k in range(len(roles))])

    def log_policy_stats(self, stats: dict[int, dict[str, float]]) -> None:
        """Per turn, over the last epoch's tokens: approximate KL to the behaviour policy (measured
        before each mini-batch's step), clip fraction, entropy."""
        for turn, stat in stats.items():
            tokens = max(stat["tokens"], 1.0)
            values = {"approx_kl": stat["approx_kl"] / tokens, "clip_frac": stat["clip_frac"] / tokens}
            if self.update.entropy_coef > 0:
                values["entropy"] = stat["entropy"] / tokens
            self.record({f"turn_{turn}/{key}": value for key, value in values.items()}, weight=tokens)
