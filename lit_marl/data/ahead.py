"""One-step off-policy rollouts (``data.max_staleness: 1``): the next step's training rollout is generated
while this step updates, as verl's ``one_step_off_policy`` does.

At training step k the data module hands out batch k's rollout, generated during step k-1's update with
the weights step k-1 started from (one update old: staleness 1), then sends the current weights to the
servers and starts batch k+1's rollout in a background thread (its tasks known ahead: the task order
is seeded, ``TaskLoader.upcoming``), which runs while step k updates. The first step, the first after
an epoch's end and the first after a resume roll out on the spot (staleness 0): a rollout in flight is
not in a checkpoint; a resumed run generates it again with the weights it resumed. Only an engine that
generates off the trainer's devices can overlap (``vllm_server``), and the background thread touches
no weight: the engine serves what the last sync sent and draws its seeds from a generator of its own.
The update weighs the one-update-old rows by the truncated importance ratio of the trainer's
log-probs over the engine's (``model.update.rollout_is_cap``). A failed background rollout raises at
the step that would have used it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass


@dataclass
class _Pending:
    tasks: list[dict]
    updates: int  # updates done when it started: its weights are those the next update starts from
    future: Future


class RolloutsAhead:
    """The rollout in flight for the next training step, and how old each handed-out one is."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lit_marl_rollout_ahead")
        self.pending: _Pending | None = None
        self.handed = 0  # training rollouts handed out (each then trained: one update)

    def take(self, tasks: list[dict], roll_out: Callable[[], object]) -> tuple[object, dict[str, float]]:
        """This step's rollout of ``tasks`` (the one in flight if it is of these tasks, else ``roll_out()``
        now) and its stats: updates since its weights (``train/staleness``), the seconds waited for it."""
        started = time.perf_counter()
        pending, self.pending = self.pending, None
        if pending is not None and pending.tasks == tasks:
            batch, staleness = pending.future.result(), self.handed - pending.updates
        else:
            if pending is not None:
                wait([pending.future])  # of other tasks (an epoch's end): dropped, never trained
            batch, staleness = roll_out(), 0
        return batch, {"train/staleness": float(staleness), "perf/rollout_wait_s": time.perf_counter() - started}

    def start(self, tasks: list[dict] | None, roll_out: Callable[[list[dict]], object]) -> None:
        """Start ``roll_out(tasks)`` in the background (the weights sent already); count the step handed out."""
        if tasks is not None:
            self.pending = _Pending(tasks, self.handed, self.pool.submit(roll_out, tasks))
        self.handed += 1

    def drop(self) -> None:
        """Forget the rollout in flight once it has finished (the run ends: it is never trained)."""
        self.settle()
        self.pending = None

    def settle(self) -> None:
        """Wait until no rollout is in flight (before the engine's weights change, or the run ends); its
        result, or its error, stays for the step that takes it."""
        if self.pending is not None:
            wait([self.pending.future])
