"""MAGRPO: multi-agent group-relative policy optimization on joint rollout trees.

Each agent's response is scored by the joint reward of the joint action(s) it took part in; the
advantage compares it with its siblings (the G responses the agent sampled at the same node).
Each agent then takes one policy-gradient step on its own samples with its own optimizer.
"""

from __future__ import annotations

from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.algorithms.base import AgentTeamModule, Timer
from lit_marl.generation import completion_logprobs
from lit_marl.returns import AdvantageMode, group_advantages
from lit_marl.rollout.batch import AgentSamples, RolloutBatch


class MAGRPO(AgentTeamModule):
    def __init__(
        self,
        advantage_mode: AdvantageMode = "mean",
        advantage_normalization: bool = True,
        advantage_std_floor: float = 1e-3,
        logprob_reduction: Literal["sum", "mean"] = "sum",
        **kwargs,
    ):
        """
        Args:
            advantage_mode: Baseline within each node's G siblings: ``mean`` (MAGRPO), ``raw``
                (MAREINFORCE), ``max`` (MAReMax) or ``rloo`` (MARLOO, leave-one-out).
            advantage_normalization: Divide each node's advantages by the std of its returns.
            advantage_std_floor: Lower bound of that std.
            logprob_reduction: REINFORCE on the ``sum`` of a response's token log-probs (the
                sequence log-likelihood) or on their ``mean`` (length-normalized).
            **kwargs: The team's settings (model, lora, learning_rate, ...): see ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        if advantage_mode not in ("mean", "raw", "max", "rloo"):
            raise ConfigError(f"model.advantage_mode={advantage_mode!r}: choose mean, raw, max or rloo")
        if logprob_reduction not in ("sum", "mean"):
            raise ConfigError(f"model.logprob_reduction={logprob_reduction!r}: choose sum or mean")
        if not advantage_std_floor > 0:
            raise ConfigError(f"model.advantage_std_floor={advantage_std_floor}: must be > 0")

    def setup(self, stage: str) -> None:
        super().setup(stage)
        data = self.trainer.datamodule
        if stage == "fit" and data is not None and data.num_generations < 2:
            raise ConfigError(
                f"data.num_generations={data.num_generations}: MAGRPO compares each response with its "
                "siblings and needs at least 2 per node; set data.num_generations >= 2"
            )

    def advantages(self, samples: AgentSamples) -> torch.Tensor:
        """Rows come grouped by node, all groups of one size (one per tree node)."""
        num_groups = int(samples.group_ids.max()) + 1
        grouped = samples.returns.view(num_groups, -1)
        hp = self.hparams
        adv = group_advantages(grouped, hp.advantage_mode, hp.advantage_normalization, hp.advantage_std_floor)
        return adv.reshape(-1)

    def policy_loss(self, model: torch.nn.Module, samples: AgentSamples) -> torch.Tensor:
        """Summed over rows: -A * (sum or mean of the log-probs of the response's tokens, end token
        included, padding excluded)."""
        logprobs = completion_logprobs(
            model, samples.input_ids, samples.attention_mask, samples.num_completion, prompt_groups=samples.group_ids
        )
        mask = samples.completion_mask.float()
        seq_logprob = (logprobs * mask).sum(-1)
        if self.hparams.logprob_reduction == "mean":
            seq_logprob = seq_logprob / mask.sum(-1).clamp(min=1)
        return -(samples.advantages * seq_logprob).sum()

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        with Timer() as train_time:
            for i, (agent, samples) in enumerate(zip(self.agents, batch.agents)):
                advantages = self.advantages(samples)
                # Rows with zero advantage carry no gradient: skip their forward/backward, but keep
                # at least one so that every agent (and rank) takes the same steps.
                rows = torch.nonzero(advantages != 0).flatten()
                if rows.numel() == 0:
                    rows = rows.new_zeros(1)
                kept = samples.with_advantages(advantages).select(rows)
                # normalized by the whole batch, so dropping zero rows changes no gradient
                scale = len(kept) / len(samples)
                loss = self.update_agent(i, kept, lambda mb, m=agent.model, s=scale: self.policy_loss(m, mb) * s)
                self.log(f"train/loss_agent{i}", loss, batch_size=len(samples))
                self.log(f"train/advantage_abs_agent{i}", advantages.abs().mean(), batch_size=len(samples))
        self.log("time/train_s", train_time.seconds)
        self.log_rollout(batch, "train")
