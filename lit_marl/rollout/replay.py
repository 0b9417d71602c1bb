"""Preference replay across iterations (iterative preference training): every step's pairs go to
a shard file on disk; a step trains on its new pairs or on a sample drawn from the shards of recent
iterations, as CoMLRL's ``preference_replay_mode``.

A shard is one iteration's pairs (one file per training step of it and rank, written atomically).
Which shards a step may draw from, by the iteration's age (0: the current one, this step's pairs
included):

- ``current``: none; the step's new pairs only.
- ``nearest_k``: ages 0 .. k - 1, each non-empty shard equally likely.
- ``all_history``: every shard, equally likely.
- ``lambda_decay``: every shard, with weight (1 - l) l^age, normalised (l = 1: equal weights).

A sample of ``sample_size`` pairs (default: as many as the step's new pairs) picks a shard per pair
by those weights, then pairs uniformly within the shard without replacement (cycling through it
when more are asked than it holds). The list of shard files is part of the checkpoint, so a resumed
run draws from exactly the shards the interrupted one had written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.rollout.pairs import PreferenceSamples

ReplayMode = Literal["current", "nearest_k", "all_history", "lambda_decay"]


def replay_weights(ages: list[int], mode: ReplayMode, k: int | None = None, lam: float | None = None) -> list[float]:
    """The draw weight of each shard (by its iteration's age), normalised to sum 1; 0 for an ineligible one."""
    if mode == "current":
        weights = [1.0 if age == 0 else 0.0 for age in ages]
    elif mode == "nearest_k":
        weights = [1.0 if age < k else 0.0 for age in ages]
    elif mode == "all_history":
        weights = [1.0 for _ in ages]
    elif mode == "lambda_decay":
        weights = [1.0 if lam == 1.0 else (1.0 - lam) * lam**age for age in ages]
    else:
        raise ValueError(f"preference_replay_mode={mode!r}: choose current, nearest_k, all_history or lambda_decay")
    total = sum(weights)
    return [w / total for w in weights] if total > 0 else weights


@dataclass(frozen=True)
class ReplaySettings:
    mode: ReplayMode = "current"
    k: int | None = None
    lam: float | None = None
    sample_size: int | None = None

    def __post_init__(self):
        """CoMLRL's rules: each setting belongs to one mode."""
        if self.mode == "nearest_k" and self.k is None:
            raise ConfigError(
                "model.preference_replay_mode=nearest_k needs model.preference_replay_k (how many iterations)"
            )
        if self.mode != "nearest_k" and self.k is not None:
            raise ConfigError(
                f"model.preference_replay_k={self.k} is for preference_replay_mode: nearest_k "
                f"(the mode is {self.mode!r})"
            )
        if self.mode == "lambda_decay" and self.lam is None:
            raise ConfigError(
                "model.preference_replay_mode=lambda_decay needs model.preference_replay_lambda in [0, 1]"
            )
        if self.mode != "lambda_decay" and self.lam is not None:
            raise ConfigError(
                f"model.preference_replay_lambda={self.lam} is for preference_replay_mode: lambda_decay "
                f"(the mode is {self.mode!r})"
            )
        if self.mode == "current" and self.sample_size is not None:
            raise ConfigError(
                "model.preference_replay_sample_size is for the replay modes (nearest_k, all_history, lambda_decay): "
                "preference_replay_mode=current trains on each step's new pairs"
            )


@dataclass(frozen=True)
class Shard:
    iteration: int
    step: int
    path: str
    pairs: int


class PreferenceReplay:
    """One rank's shard files under ``directory/rank<r>/`` and the draws from them."""

    def __init__(self, directory: str | Path, rank: int, settings: ReplaySettings, pad_ids: list[int]):
        self.directory = Path(directory) / f"rank{rank}"
        self.settings = settings
        self.pad_ids = pad_ids
        self.shards: list[Shard] = []
        self._loaded: dict[str, PreferenceSamples] = {}

    def write(self, iteration: int, step: int, rows: PreferenceSamples) -> None:
        """Save a step's pairs (atomically: a killed run leaves the old file or the new one, never half)."""
        if not len(rows):
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"iteration_{iteration:04d}_step_{step:06d}.pt"
        partial = path.with_suffix(".pt.partial")
        torch.save({"iteration": iteration, "step": step, "rows": rows.state_dict()}, partial)
        os.replace(partial, path)
        self.shards = [s for s in self.shards if s.step != step] + [Shard(iteration, step, str(path), len(rows))]
        self._loaded[str(path)] = rows

    def draw(self, iteration: int, fresh: PreferenceSamples, generator: torch.Generator) -> PreferenceSamples:
        """The pairs a step trains on: ``fresh`` (written already) with mode ``current``, else a sample."""
        settings = self.settings
        if settings.mode == "current":
            return fresh
        by_iteration: dict[int, list[Shard]] = {}
        for shard in self.shards:
            if shard.iteration <= iteration:
                by_iteration.setdefault(shard.iteration, []).append(shard)
        iterations = sorted(by_iteration)
        weights = replay_weights([iteration - it for it in iterations], settings.mode, settings.k, settings.lam)
        size = settings.sample_size or len(fresh) or (by_iteration[iterations[-1]][-1].pairs if iterations else 0)
        if not size or not any(weights):
            return fresh
        picks = torch.multinomial(
            torch.tensor(weights, dtype=torch.double), size, replacement=True, generator=generator
        )
        counts = torch.bincount(picks, minlength=len(iterations)).tolist()
        parts = []
        for it, count in zip(iterations, counts):
            if count:
                pool = PreferenceSamples.cat([self._rows(s) for s in by_iteration[it]], self.pad_ids)
                parts.append(pool.select(_without_replacement(len(pool), count, generator)))
        return PreferenceSamples.cat(parts, self.pad_ids)

    def _rows(self, shard: Shard) -> PreferenceSamples:
        if shard.path not in self._loaded:
            self._loaded[shard.path] = PreferenceSamples.from_state_dict(
                torch.load(shard.path, weights_only=True)["rows"]
            )
        return self._loaded[shard.path]

    def state_dict(self) -> dict:
        return {"shards": [vars(s) for s in self.shards]}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's shard list; every file must still be there (later steps' files of an
        interrupted run are not in it and get rewritten)."""
        shards = [Shard(**s) for s in state["shards"]]
        missing = [s.path for s in shards if not Path(s.path).is_file()]
        if missing:
            raise ConfigError(
                f"the checkpoint's preference replay shards are missing: {missing[:3]}: the replay folder "
                "(model.preference_replay_dir) was moved or deleted; restore it to resume"
            )
        self.shards, self._loaded = shards, {}


def _without_replacement(n: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` indices of ``n``: a random permutation, repeated (each a new one) when count > n."""
    rounds = [torch.randperm(n, generator=generator) for _ in range(-(-count // n))]
    return torch.cat(rounds)[:count]
