"""The data modules: task rows in, rollouts out, built on the fly with the current policies.
``base.py`` holds every data module's settings, ``trees.py`` the joint rollout trees,
``episodes.py`` the multi-turn episodes."""

from lit_marl.data.base import Evaluated, TaskDataModule, build_engine
from lit_marl.data.episodes import EpisodeDataModule
from lit_marl.data.trees import RolloutDataModule

__all__ = ["EpisodeDataModule", "Evaluated", "RolloutDataModule", "TaskDataModule", "build_engine"]
