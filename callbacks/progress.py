"""A progress bar that tells the truth about RL steps: what the run is doing (rollout or update, SFT
or RL), the step's reward and tokens/s, and a step rate and ETA from whole steps.

Lightning's rich bar reads its rate from a 30 s window of updates, so a run whose steps take a
minute shows ``0.00it/s`` and no ETA (``-:--:--``), and it never knows of ``trainer.max_time``. Here
the rate is the training wall time over the steps done, the ETA the steps left at that rate, or the
time cap's remaining time where that comes first (then marked ``time cap``)."""

from __future__ import annotations

import time
from datetime import timedelta

from lightning.pytorch.callbacks import RichProgressBar, Timer
from rich.progress import ProgressColumn
from rich.text import Text


class RunProgressBar(RichProgressBar):
    """Lightning's rich progress bar with the run's phase and activity in the description, the
    step's reward and tokens/s, and ``RunTimeColumn``'s rate and ETA. The CLI puts it in place of
    Lightning's default bar (an explicitly configured bar is kept)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.started: float | None = None  # when the first training step's rollout began
        self.first_step = 0  # training steps done then (a resumed run's earlier steps)

    def configure_columns(self, trainer) -> list:
        columns = super().configure_columns(trainer)
        return columns[:3] + [RunTimeColumn(self, style=self.theme.time)]  # in place of time and it/s

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.started is None:
            self.started, self.first_step = time.perf_counter(), self._processed()
        self._describe(pl_module, "rollout")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._describe(pl_module, "update")  # the step's rollout is done: the data module made it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._describe(pl_module, "rollout")  # the next step starts with its rollout

    def on_train_end(self, trainer, pl_module) -> None:
        self._describe(pl_module, "done")
        super().on_train_end(trainer, pl_module)

    def _describe(self, pl_module, activity: str) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        phase = "SFT" if pl_module.phase == "sft" else "RL"
        where = "" if activity == "done" else f" epoch {self.trainer.current_epoch}"
        self.progress.update(self.train_progress_bar_id, description=f"{phase}{where} · {activity}")
        self.refresh()

    def get_metrics(self, trainer, pl_module) -> dict:
        items = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        step = pl_module.step_metrics
        shown = {"loss": "train/sft_loss" if pl_module.phase == "sft" else "train/loss", "reward": "train/reward"}
        for name, key in shown.items():
            if key in step:
                items[name] = f"{step[key]:.3f}"
        if "perf/tokens_per_s" in step:
            items["tok/s"] = f"{step['perf/tokens_per_s']:.0f}"
        return items

    def _processed(self) -> int:
        """Training steps done (``completed`` lags a step in ``on_train_batch_end``)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.total.processed

    def estimate(self) -> tuple[float | None, float | None, bool]:
        """(seconds per step, seconds left, whether the time cap ends the run first): from the
        training time so far over the steps done (None before the first step ends)."""
        trainer, done = self.trainer, self._processed()
        if self.started is None or done <= self.first_step:
            return None, None, False
        per_step = (time.perf_counter() - self.started) / (done - self.first_step)
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        total = epochs * trainer.num_training_batches if epochs is not None else float("inf")
        left = (total - done) * per_step if total != float("inf") else None
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        cap = timer.time_remaining() if timer is not None else None
        if cap is not None and (left is None or cap < left):
            return per_step, max(cap, 0.0), True
        return per_step, left, False


class RunTimeColumn(ProgressColumn):
    """``elapsed • ETA (time cap) • rate``: the rate in s/step below one step a second, else steps/s."""

    max_refresh = 0.5

    def __init__(self, bar: RunProgressBar, style) -> None:
        self.bar, self.style = bar, style
        super().__init__()

    def render(self, task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        per_step, left, capped = self.bar.estimate()
        clock = "-:--:--" if elapsed is None else str(timedelta(seconds=int(elapsed)))
        eta = "-:--:--" if left is None else str(timedelta(seconds=int(left)))
        if per_step is None:
            rate = "-- s/step"
        else:
            rate = f"{per_step:.1f} s/step" if per_step >= 1 else f"{1 / per_step:.2f} steps/s"
        return Text(f"{clock} • {eta}{' (time cap)' if capped else ''} • {rate}", style=self.style)


def use_run_progress_bar(trainer):
    """``trainer`` with a ``RunProgressBar`` in place of Lightning's default rich bar (the one it
    adds when no bar is configured); a bar the config names, or none, is left as it is."""
    for i, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar:
            trainer.callbacks[i] = RunProgressBar()
    return trainer
