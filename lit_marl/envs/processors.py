"""Reward processors: what training sees of a reward (CoMLRL's ``RewardProcessors``), composable.

``data.reward_processor`` is a list of steps applied in order to every joint action's task reward
before returns are built; logs, early termination and evaluation keep the task reward::

    reward_processor:
      - {kind: clamp, min: 0.0, max: 1.0}
      - {kind: scale, factor: 2.0}

``reward_range`` is metadata (never a clip): the range of the task reward (``data.reward_range``, or
the reward function's ``reward_range`` attribute as in CoMLRL), so the reward histograms of a run
have fixed bins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lit_marl import ConfigError

# kind -> its parameters with their defaults (CoMLRL's where it has the processor)
KINDS: dict[str, dict[str, float]] = {
    "identity": {},
    "clamp": {"min": -10.0, "max": 10.0},
    "scale": {"factor": 1.0},
    "shift": {"offset": 0.0},
    "sigmoid_scale": {},
    "normalize_by_length": {"max_len": 1000.0},
}


@dataclass(frozen=True)
class Step:
    kind: str
    params: tuple[tuple[str, float], ...] = ()

    def __getitem__(self, name: str) -> float:
        return dict(self.params)[name]


@dataclass(frozen=True)
class RewardProcessor:
    """Steps applied in order (an empty list: the identity)."""

    steps: tuple[Step, ...] = ()

    @classmethod
    def parse(cls, spec: list[dict] | None, field: str = "data.reward_processor") -> "RewardProcessor":
        """From the config's list of ``{kind: ..., <parameter>: <number>}``; a bad entry raises naming it."""
        steps = []
        for i, entry in enumerate(spec or []):
            where = f"{field}[{i}]"
            if not isinstance(entry, dict) or "kind" not in entry:
                raise ConfigError(
                    f"{where}={entry!r}: give a mapping with `kind` ({', '.join(KINDS)}) and its parameters"
                )
            kind = entry["kind"]
            if kind not in KINDS:
                raise ConfigError(f"{where}.kind={kind!r}: choose one of {', '.join(KINDS)}")
            unknown = set(entry) - {"kind"} - set(KINDS[kind])
            if unknown:
                raise ConfigError(
                    f"{where}: {kind} takes {sorted(KINDS[kind]) or 'no parameters'}, not {sorted(unknown)}"
                )
            params = {**KINDS[kind], **{k: v for k, v in entry.items() if k != "kind"}}
            for name, value in params.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ConfigError(f"{where}.{name}={value!r}: must be a finite number")
            if kind == "clamp" and not params["min"] < params["max"]:
                raise ConfigError(f"{where}: clamp needs min < max, got min={params['min']}, max={params['max']}")
            if kind == "normalize_by_length" and params["max_len"] <= 0:
                raise ConfigError(f"{where}.max_len={params['max_len']}: must be > 0")
            steps.append(Step(kind, tuple((k, float(v)) for k, v in params.items())))
        return cls(tuple(steps))

    def __bool__(self) -> bool:
        return any(step.kind != "identity" for step in self.steps)

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``rewards`` of joint actions (e.g. ``[nodes, J, agents]``); ``lengths``: each joint action's
        answer length in characters (``normalize_by_length``), its shape the leading dimensions of ``rewards``."""
        out = rewards.double()
        for step in self.steps:
            if step.kind == "clamp":
                out = out.clamp(step["min"], step["max"])
            elif step.kind == "scale":
                out = out * step["factor"]
            elif step.kind == "shift":
                out = out + step["offset"]
            elif step.kind == "sigmoid_scale":
                out = torch.sigmoid(out)
            elif step.kind == "normalize_by_length":
                if lengths is None:
                    raise ValueError("normalize_by_length needs each joint action's length")
                factor = (lengths.double() / step["max_len"]).clamp(max=1.0)
                out = out * factor.view(*factor.shape, *([1] * (out.dim() - factor.dim())))
        return out.to(rewards.dtype)


def check_range(value, field: str) -> tuple[float, float] | None:
    """A ``[min, max]`` reward range (None: none given): two finite numbers, min < max."""
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok or not value[0] < value[1]:
        raise ConfigError(f"{field}={value!r}: give [min, max], two finite numbers with min < max")
    return float(value[0]), float(value[1])
