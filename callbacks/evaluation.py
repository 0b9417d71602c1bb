"""Greedy evaluation on the held-out tasks before and after training, printed side by side."""

from __future__ import annotations

import time

import lightning as L

from lit_marl import ConfigError


class HeldOutEvaluation(L.Callback):
    def __init__(self, metric: str = "reward"):
        """
        Args:
            metric: The reported metric that the before/after line leads with (``reward`` or one the
                reward function reports, e.g. ``success``).
        """
        self.metric = metric
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if not getattr(trainer.datamodule, "val_tasks", None):  # checked before any model loads
            raise ConfigError("HeldOutEvaluation needs held-out tasks: set data.val_path")

    def evaluate(self, trainer: L.Trainer, pl_module, tag: str) -> dict[str, float]:
        with pl_module.gathered():
            results = trainer.datamodule.evaluate(pl_module.agents)
        if self.metric not in results:
            raise ConfigError(
                f"HeldOutEvaluation.metric={self.metric!r} is not reported; choose from {sorted(results)}"
            )
        if trainer.is_global_zero:  # x: training steps done (0 before training), as every training log
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": v for k, v in results.items()}, step=pl_module.training_steps)
        print(f"[held-out, {tag}] " + "  ".join(f"{k}={v:.3f}" for k, v in sorted(results.items())), flush=True)
        return results

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.before = self.evaluate(trainer, pl_module, "before training")
        self.train_start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        steps = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        print(f"Trained {steps} steps in {time.perf_counter() - self.train_start:.0f} s", flush=True)
        self.after = self.evaluate(trainer, pl_module, "after training")
        m = self.metric
        print(f"\nHeld-out {m} (greedy): before {self.before[m]:.3f} -> after {self.after[m]:.3f}", flush=True)
        if trainer.logger is not None and trainer.logger.log_dir:
            print(
                f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir})",
                flush=True,
            )
