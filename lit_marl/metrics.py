"""What the log line is made of: wall-clock timers and means over ranks weighted by their rows."""

from __future__ import annotations

import time

from lit_marl.parallel.collectives import gather_objects


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def weighted_means(values: dict[str, float], weight: float) -> tuple[dict[str, float], float]:
    """Each key's mean over the ranks that report it, weighted by their ``weight`` (ranks whose
    trees ended early report no later turns, so the keys can differ: one object gather, not one
    reduce per key); and the summed weight. One process: ``values`` and ``weight`` as given."""
    gathered = gather_objects((values, weight))
    if len(gathered) == 1:
        return values, weight
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for rank_values, rank_weight in gathered:
        for key, value in rank_values.items():
            sums[key] = sums.get(key, 0.0) + value * rank_weight
            weights[key] = weights.get(key, 0.0) + rank_weight
    return {key: sums[key] / weights[key] for key in sums}, sum(w for _, w in gathered)
