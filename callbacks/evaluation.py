"""Evaluation on the held-out tasks before training, every n steps, and after, printed side by side."""

from __future__ import annotations

import time

import lightning as L
import torch

from lit_marl import ConfigError
from lit_marl.fields import NonNegativeInt, PositiveInt, check_fields


class HeldOutEvaluation(L.Callback):
    """Greedy (or sampled) rollouts on every held-out task: logged as ``eval/<metric>`` at the
    training steps done (0 before training), printed, and the before -> after line at the end."""

    def __init__(
        self,
        metric: str = "reward",
        every_n_steps: NonNegativeInt = 0,
        num_samples: PositiveInt = 1,
        pass_at_k: list[PositiveInt] | None = None,
        examples: NonNegativeInt = 3,
    ):
        """
        Args:
            metric: The reported metric that the before/after line leads with (``reward`` or one the
                reward function reports, e.g. ``success``; ``pass@k`` with ``pass_at_k``).
            every_n_steps: Also evaluate after every n training steps (0: before and after only);
                each evaluation costs one rollout of every held-out task.
            num_samples: 1: greedy, one rollout per task (the default); n > 1: n sampled rollouts
                per task at the training temperature (trees: aligned, their leaves are the samples).
            pass_at_k: With ``num_samples`` >= k: the unbiased pass@k of each k (Chen et al. 2021)
                from each task's samples that succeed (the reward's ``success``, a game's ``won``).
            examples: At the end, print the first n held-out tasks' answers before and after
                training side by side (greedy tree rollouts; 0: none), to read what was learnt.
        """
        check_fields("HeldOutEvaluation", HeldOutEvaluation.__init__, locals())
        self.pass_at_k = list(pass_at_k or [])
        if any(k < 1 for k in self.pass_at_k):
            raise ConfigError(f"HeldOutEvaluation.pass_at_k={self.pass_at_k}: every k must be >= 1")
        if any(k > num_samples for k in self.pass_at_k):
            raise ConfigError(
                f"HeldOutEvaluation.pass_at_k={self.pass_at_k} needs num_samples >= {max(self.pass_at_k)} "
                f"(got {num_samples}): raise num_samples, or drop the larger k"
            )
        self.metric, self.every_n_steps, self.num_samples = metric, every_n_steps, num_samples
        self.examples = examples
        self.before_examples: list[dict] = []  # the data module's ``examples`` of the first evaluation
        self.before: dict[str, float] | None = None
        self.after: dict[str, float] | None = None
        self.history: list[tuple[int, dict[str, float]]] = []  # (training steps done, results) of each evaluation

    @property
    def how(self) -> str:
        return "greedy" if self.num_samples == 1 else f"{self.num_samples} samples per task"

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if trainer.datamodule is None or not trainer.datamodule.val_tasks:  # checked before any model loads
            raise ConfigError("HeldOutEvaluation needs held-out tasks: set data.val_path")

    def evaluate(self, trainer: L.Trainer, pl_module, tag: str) -> dict[str, float]:
        data, step, how = trainer.datamodule, pl_module.training_steps, self.how
        if trainer.is_global_zero:  # a long evaluation is a visible wait, not a silent one
            print(f"[held-out, {tag}] evaluating {len(data.val_tasks)} tasks ({how}) ...", flush=True)
        start = time.perf_counter()
        device = pl_module.device
        # through the rollout engine, as a rollout (vLLM serves the weights: no whole-model gather);
        # sampled rollouts draw random numbers: training's stream goes on as if none had been drawn
        with (
            data.generating(pl_module.team()),
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        ):
            results = data.evaluate(pl_module.agents, self.num_samples, self.pass_at_k)
        pl_module.exclude_from_step_time(time.perf_counter() - start)  # perf/step_s: the steps' own time
        if self.metric not in results:
            raise ConfigError(
                f"HeldOutEvaluation.metric={self.metric!r} is not reported; choose from {sorted(results)}"
            )
        self.history.append((step, results))
        if trainer.is_global_zero:  # x: training steps done (0 before training), as every training log
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": v for k, v in results.items()}, step=step)
            # per-turn figures only in the logs: in a one-turn run they repeat the totals
            shown = "  ".join(f"{k}={v:.3f}" for k, v in sorted(results.items()) if not k.startswith("turn_"))
            print(f"[held-out, {tag}] {shown}  ({time.perf_counter() - start:.0f} s)", flush=True)
        return results

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.before = self.evaluate(trainer, pl_module, "before training")
        self.before_examples = list(trainer.datamodule.examples)
        self.train_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = pl_module.training_steps
        if self.every_n_steps and step % self.every_n_steps == 0 and not self._last_step(trainer):
            self.evaluate(trainer, pl_module, f"after {step} steps")

    @staticmethod
    def _last_step(trainer: L.Trainer) -> bool:
        """This step ends the run (the after-training evaluation follows at once): a step cap reached."""
        done = trainer.fit_loop.epoch_loop.batch_progress.total.ready
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        return trainer.should_stop or (epochs is not None and done >= epochs * trainer.num_training_batches)

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        steps = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        print(f"Trained {steps} steps in {time.perf_counter() - self.train_start:.0f} s", flush=True)
        self.after = self.evaluate(trainer, pl_module, "after training")
        if not trainer.is_global_zero:
            return
        after_examples = list(trainer.datamodule.examples)
        print(
            "\n" + report(self.before, self.after, self.before_examples, after_examples, self.examples, self.how),
            flush=True,
        )
        m = self.metric
        print(f"\nHeld-out {m} ({self.how}): before {self.before[m]:.3f} -> after {self.after[m]:.3f}", flush=True)
        if trainer.logger is not None and trainer.logger.log_dir:
            print(
                f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir}; "
                f"curves as a PNG: lit-marl plot {trainer.logger.log_dir})",
                flush=True,
            )


def report(
    before: dict, after: dict, before_examples: list[dict], after_examples: list[dict], n: int, how: str = "greedy"
) -> str:
    """The before -> after table of every held-out metric (per-turn ones only in the logs), then the
    first ``n`` tasks' answers before and after training (the same tasks, in evaluation order)."""
    keys = [k for k in sorted(after) if not k.startswith("turn_") and k in before]
    width = max(len(k) for k in keys + ["held-out"])
    lines = [f"{'held-out':<{width}}  before  ->  after  ({how})"]
    lines += [f"{k:<{width}}  {before[k]:6.3f}  ->  {after[k]:.3f}" for k in keys]
    pairs = list(zip(before_examples, after_examples))[:n]
    if pairs:
        lines.append(f"\nThe first {len(pairs)} held-out tasks, before -> after:")
    for old, new in pairs:
        task = old["task"]
        lines.append("  " + "  ".join(f"{k}: {v}" for k, v in task.items() if k != "id") + f"  ({task.get('id', '')})")
        for when, example in (("before", old), ("after", new)):
            lines.append(f"    {when} (reward {example['reward']:.3f}):")
            lines += [f"      agent {i}: {_one_line(text)}" for i, text in enumerate(example["lines"])]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    """An answer on one line, its line breaks shown (a rule may count them)."""
    return " ⏎ ".join(line.strip() for line in str(text).strip().splitlines())
