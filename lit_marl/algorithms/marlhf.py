"""MARLHF's first phase: a joint reward model fit with Bradley-Terry on preference pairs (CoMLRL's MARLHF).

The team (frozen, never trained here) samples K joint candidates per task exactly as for MADPO;
the task reward (after ``data.reward_processor``) ranks them and ``rollout/pairs.py`` picks the pairs; the reward model
(``envs/learned.py``: a causal-LM backbone, a linear head on the last token of the joint answer as
text) learns -log sigmoid(s_w - s_l) (``losses.bradley_terry``). At the end of the fit it is saved
to ``reward_model_dir``; a second run trains any online algorithm on it with
``data.reward_model: <that folder>`` (held-out evaluation keeps the task reward).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.algorithms.settings import read_groups
from lit_marl.envs.learned import JointRewardModel, joint_text
from lit_marl.fields import PositiveFloat, PositiveInt, check_fields
from lit_marl.losses import bradley_terry
from lit_marl.metrics import Timer
from lit_marl.models import check_source
from lit_marl.rollout.batch import RolloutBatch
from lit_marl.rollout.pairs import PAIR_FIELDS, PairSettings, check_candidate_rollouts, rollout_pairs


@dataclass
class PairSamples:
    """Chosen and rejected joint answers, tokenized for the reward model: one row per pair (its
    width and tokens are both answers', which is what a pass over it computes)."""

    chosen: tuple[torch.Tensor, torch.Tensor]  # ids, mask [P, Wc]
    rejected: tuple[torch.Tensor, torch.Tensor]  # ids, mask [P, Wr]

    def __len__(self) -> int:
        return self.chosen[0].shape[0]

    def select(self, rows: torch.Tensor) -> "PairSamples":
        return PairSamples(tuple(t[rows] for t in self.chosen), tuple(t[rows] for t in self.rejected))

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.chosen[0], self.rejected[0]], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.chosen[1], self.rejected[1]], dim=1)


class RewardModelFit(AgentTeamModule):
    """A joint reward model fit with Bradley-Terry on the team's scored joint candidates (MARLHF, phase 1)."""

    def __init__(
        self,
        reward_model_name: str | None = None,
        reward_model_dir: str = "reward_model",
        reward_learning_rate: PositiveFloat = 1e-5,
        reward_freeze_backbone: bool = False,
        reward_max_length: PositiveInt = 1024,
        pairs: PairSettings = PairSettings(),
        **kwargs,
    ):
        """
        Args:
            reward_model_name: Source of the reward model's backbone (CoMLRL's name; default: the first
                agent's ``model``).
            reward_model_dir: Where the trained reward model is written at the end of the fit (a
                folder: the backbone as an HF model, the head beside it); ``data.reward_model`` reads it.
            reward_learning_rate: AdamW learning rate of the reward model (CoMLRL's default 1e-5).
            reward_freeze_backbone: Train the linear head only.
            reward_max_length: Tokens of a joint answer the reward model reads (its end is kept).
            pairs: Which pairs a task's candidates give (``rollout.pairs.PairSettings``), as in ``MADPO``.
            **kwargs: The team that samples the candidates (model, lora, ...; it is not trained): see
                ``AgentTeamModule``.
        """
        super().__init__(**kwargs)
        check_fields("model", RewardModelFit.__init__, locals())
        read_groups(self, {"pairs": PAIR_FIELDS}, pairs=(PairSettings, pairs))
        self.pair_settings = self.pairs.of(type(self))
        team = self.hparams.model  # its sources are checked already
        self.reward_source = reward_model_name or (team if isinstance(team, str) else team[0])
        if reward_model_name is not None:
            check_source(reward_model_name, "model.reward_model_name")
        self.reward_model_dir = reward_model_dir
        self.reward_learning_rate = reward_learning_rate
        self.reward_freeze_backbone = reward_freeze_backbone
        self.reward_max_length = reward_max_length
        self.reward_net: JointRewardModel | None = None

    def build_models(self) -> None:
        super().build_models()
        for agent in self.agents:  # the team only samples candidates
            agent.requires_grad_(False)
        if self.reward_net is None:
            self.reward_net = JointRewardModel(self.reward_source, self.reward_freeze_backbone, self.reward_max_length)

    def configure_optimizers(self):
        params = [p for p in self.reward_net.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.reward_learning_rate, weight_decay=self.weight_decay)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.require_groups(stage, "joint candidates of the same task in pairs")
        if stage == "fit":
            check_candidate_rollouts(self.rollout_settings, "RewardModelFit")

    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        with Timer() as train_time:
            rows = self.pair_rows(batch)  # None: every candidate of every task tied
            stats = {"correct": 0.0, "margin": 0.0}
            pairs = float(len(rows)) if rows is not None else 0.0
            loss = self.optimizer_step_on(
                self.optimizers(), rows, lambda mb: self.pair_loss(mb, stats), "reward_model", count=pairs
            )
        if pairs:
            self.record(
                {
                    "train/loss": loss,
                    "train/rm_accuracy": stats["correct"] / pairs,
                    "train/rm_margin": stats["margin"] / pairs,
                },
                weight=pairs,
            )
        self.record({"train/pairs": pairs}, reduce="sum")
        self.record({"perf/train_s": train_time.seconds})
        self.log_rollout(batch, "train")

    def pair_rows(self, batch: RolloutBatch) -> PairSamples | None:
        """Every task's selected pairs of joint answers, as the reward model's token rows (None: no pair)."""
        pairs = rollout_pairs(batch, self.pair_settings, self.shuffle_generator)
        if not len(pairs.chosen):
            return None

        def texts(rows: torch.Tensor) -> list[str]:  # candidate row j: every agent's prompt and answer j
            return [joint_text([p[j] for p in batch.prompts], [c[j] for c in batch.completions]) for j in rows.tolist()]

        return PairSamples(self.reward_net.encode(texts(pairs.chosen)), self.reward_net.encode(texts(pairs.rejected)))

    def pair_loss(self, rows: PairSamples, stats: dict) -> torch.Tensor:
        """Summed over pairs: -log sigmoid(s_w - s_l)."""
        chosen, rejected = self.reward_net(*rows.chosen), self.reward_net(*rows.rejected)
        with torch.no_grad():
            stats["correct"] += float((chosen > rejected).sum())
            stats["margin"] += float((chosen - rejected).sum())
        return bradley_terry(chosen, rejected).sum()

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            self.reward_net.save(Path(self.reward_model_dir))
