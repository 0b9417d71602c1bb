"""What a data module's rollouts are: the one typed object an algorithm (and the memory plan)
reads from the data module, checked once in ``setup``. The data module builds it from its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lit_marl import ConfigError
from lit_marl.generation import Engine
from lit_marl.rollout.episode import EpisodeSettings
from lit_marl.rollout.tree import TreeSettings


@dataclass(frozen=True)
class RolloutSettings:
    family: Literal["tree", "episodes"]
    """Joint rollout trees (``RolloutDataModule``) or episodes (``EpisodeDataModule``)."""
    num_agents: int
    tasks_per_step: int
    num_generations: int
    """Samples per group: a tree node's responses per agent, or a task's episodes."""
    engine: Engine
    tree: TreeSettings | None = None
    episode: EpisodeSettings | None = None
    centralized: bool = False
    """One joint actor writes every role (``data.centralized_adapter``)."""
    on_reward_error: Literal["raise", "skip"] = "raise"
    demos: int = 0
    """Demonstrations loaded for an SFT phase."""
    eval_tasks_per_step: int = 16
    """Held-out tasks per evaluation batch (greedy, one response each)."""
    max_staleness: int = 0
    """Updates a training rollout's weights may lag behind (``data.max_staleness``: 1, generated ahead)."""

    def check_overlap(self, module) -> None:
        """With ``max_staleness``, the training module must sample its current agents alone (a rollout
        runs beside its update) and weigh the one-update-old rows (``model.update.rollout_is_cap``)."""
        if not self.max_staleness:
            return
        name = type(module).__name__
        if not module.overlaps_rollouts:
            raise ConfigError(
                f"data.max_staleness={self.max_staleness}: {name} samples others than its current agents "
                "(a reference, a comparator): set data.max_staleness: 0"
            )
        if module.update.rollout_is_cap is None:
            raise ConfigError(
                f"data.max_staleness={self.max_staleness}: rows are sampled by weights one update old; set "
                "model.update.rollout_is_cap (e.g. 2.0) to weigh them by the truncated importance ratio"
            )

    def require(self, family: Literal["tree", "episodes"], algorithm: str, what: str | None = None) -> None:
        """Fail, naming the data module to use, when the rollouts are of the other family."""
        if self.family != family:
            use = "RolloutDataModule" if family == "tree" else "EpisodeDataModule"
            what = what or ("learns from joint rollouts" if family == "tree" else "trains on multi-turn episodes")
            raise ConfigError(f"{algorithm} {what}: use data: lit_marl.data.{use}")

    def generation_shape(self, evaluation: bool = False) -> tuple[int, int, str]:
        """The most rows one generate call of a training step (or with ``evaluation`` of a greedy
        held-out batch) holds for one agent and their tokens, with the assumption made."""
        tasks = self.eval_tasks_per_step if evaluation else self.tasks_per_step
        if self.episode is not None:  # every task's group plays at once, contexts up to the cap
            rows = tasks * (1 if evaluation else self.episode.group_size)
            return rows, self.episode.max_context_tokens, "max_context_tokens"
        tree = self.tree  # the last turn's call: every node's G samples (cross: all agents' nodes)
        width = 1 if evaluation else tree.num_generations  # evaluation: one greedy response per node
        nodes = width ** ((tree.num_turns - 1) * (self.num_agents if tree.joint_mode == "cross" else 1))
        return tasks * nodes * width, 512 + tree.sampling.max_new_tokens, "prompts <= 512 tokens"
