"""SFT first, then RL, in one run under one budget.

The budget is counted as in the practitioner's guide: ``budget`` cost units, split between the
phases by ``split`` (``"1:4"``, or ``"60:400"``), where one RL episode costs 1 unit and one
demonstration ``demo_cost`` units. So ``budget: 460, split: "60:400"`` is 60 demonstrations then
400 episodes, and ``budget: 1000, split: "1:4", demo_cost: 2`` is 100 demonstrations then 800
episodes. ``sft_epochs`` passes over those demonstrations train on each of them that many times
(the guide's several SFT epochs on its 60 walkthroughs), each costed once. Without it, a
demonstrations file shorter than the budget is cycled and every demonstration served is costed.
What an RL episode is comes from the data module: a multi-turn episode of a stateful environment,
or one joint trajectory (root to leaf) of a rollout tree.

The run starts in the SFT phase (the training module's ``phase``: the data module then serves
rendered demonstrations and the module takes SFT steps) and, at the end of the epoch in which the
demonstrations budget is spent, switches to RL: same weights, the data source becomes rollouts
and, with ``reset_optimizers``, the optimizers start afresh. An SFT epoch ends early where the
budget runs out mid-pass (rounded up to a whole step). The RL phase stops the run once its
episodes are spent. Phase, counters and the switch point are saved in checkpoints, so a run
resumed in either phase continues there with what is left of its budget.
"""

from __future__ import annotations

import math

import lightning as L

from lit_marl import ConfigError
from lit_marl.callbacks.evaluation import HeldOutEvaluation
from lit_marl.fields import PositiveFloat, PositiveInt, check_fields
from lit_marl.metrics import REDUCED
from lit_marl.parallel.collectives import all_ranks_sum


def parse_split(split: str) -> tuple[float, float]:
    """``"1:4"`` -> (1.0, 4.0)."""
    parts = str(split).split(":")
    try:
        sft, rl = (float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"PhaseSwitch.split={split!r}: give SFT:RL shares such as '1:4' or '60:400'") from None
    if sft < 0 or rl < 0 or sft + rl == 0:
        raise ConfigError(f"PhaseSwitch.split={split!r}: the shares must be >= 0 and not both 0")
    return sft, rl


class PhaseSwitch(L.Callback):
    """Runs SFT on demonstrations, then RL on the same weights, splitting one budget between the phases."""

    def __init__(
        self,
        budget: PositiveFloat,
        split: str = "1:4",
        demo_cost: PositiveFloat = 1.0,
        reset_optimizers: bool = True,
        sft_learning_rate: PositiveFloat | None = None,
        sft_epochs: PositiveInt = 1,
    ):
        """
        Args:
            budget: Total cost of the run in units of one RL episode.
            split: Shares of the budget ``SFT:RL``, e.g. ``1:4`` or ``60:400``.
            demo_cost: Cost of one demonstration relative to one RL episode.
            reset_optimizers: Start the RL phase with fresh optimizers (no SFT moments).
            sft_learning_rate: Learning rate of the agents during SFT (default: the module's).
            sft_epochs: Passes over the SFT phase's demonstrations (each costs once, whatever the
                passes); above 1 the demonstrations file must hold exactly the budget's number.
        """
        check_fields("PhaseSwitch", PhaseSwitch.__init__, locals())
        sft, rl = parse_split(split)
        self.demos = math.floor(budget * sft / (sft + rl) / demo_cost + 1e-9)
        self.episodes = math.floor(budget * rl / (sft + rl) + 1e-9)
        self.demo_cost, self.reset_optimizers, self.sft_learning_rate = demo_cost, reset_optimizers, sft_learning_rate
        self.sft_epochs = sft_epochs
        self.phase = "sft" if self.demos > 0 else "rl"
        self.demos_done = self.episodes_done = 0.0
        self.epoch_start_demos = 0.0  # demonstrations served before the current SFT epoch began
        self.switched_at: dict | None = None  # epoch and global step of the switch

    # ------------------------------------------------------------------ saved in checkpoints
    PROGRESS = ("phase", "demos_done", "episodes_done", "epoch_start_demos", "switched_at")

    def state_dict(self) -> dict:
        return {key: getattr(self, key) for key in (*self.PROGRESS, "demos", "episodes", "sft_epochs")}

    def load_state_dict(self, state: dict) -> None:
        saved = (state["demos"], state["episodes"], state.get("sft_epochs", 1))
        if saved != (self.demos, self.episodes, self.sft_epochs):
            raise ConfigError(
                f"PhaseSwitch: the checkpoint's budget was {saved[0]} demonstrations x {saved[2]} SFT epochs + "
                f"{saved[1]} episodes, this run's {self.demos} x {self.sft_epochs} + {self.episodes}: resume with the "
                "same budget, split, demo_cost and sft_epochs"
            )
        for key in self.PROGRESS:
            setattr(self, key, state[key])

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.runs_rl:
            raise ConfigError(
                f"PhaseSwitch hands the run to RL, which {type(pl_module).__name__} does not do: set model to an RL "
                "algorithm (PPO, GRPO, MAGRPO, IAC, ...); it takes the SFT steps itself"
            )
        data = trainer.datamodule
        if self.demos > 0 and not data.demos:
            raise ConfigError("PhaseSwitch starts with SFT: set data.demos.path (scripts/make_demos.py writes one)")
        if self.demos > 0 and self.sft_epochs > 1 and len(data.demos) != self.demos:
            raise ConfigError(
                f"PhaseSwitch.sft_epochs={self.sft_epochs} repeats the budget's {self.demos} demonstrations, but "
                f"data.demos.path holds {len(data.demos)}: give a file of exactly {self.demos} (e.g. the TextWorld "
                f"walkthroughs textworld:<complexity>:validation:{self.demos}), or sft_epochs: 1"
            )
        learns_demos = getattr(getattr(pl_module, "update", None), "sft_coef", 0) > 0
        if self.demos > 0 and learns_demos and len(data.demos) != self.demos:
            raise ConfigError(
                f"model.update.sft_coef: RL keeps learning data.demos.path's {len(data.demos)} demonstrations, but "
                f"the budget counts {self.demos}: give a file of exactly {self.demos}, so RL learns the ones SFT "
                "was charged for"
            )
        trainer.reload_dataloaders_every_n_epochs = 1  # the data module hands out the phase's loader each epoch

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        # after any checkpoint was restored, before the first loader is asked for
        pl_module.phase = self.phase
        if self.phase == "sft":
            trainer.datamodule.demo_rows = self.demos_to_serve - self.epoch_start_demos
            if self.sft_learning_rate is not None:
                self._set_learning_rate(pl_module, self.sft_learning_rate)
        if trainer.is_global_zero:
            print(f"[phase] {self.describe()}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.phase == "sft":
            self.demos_done += all_ranks_sum(len(batch[0]), pl_module.device)
        else:
            self.episodes_done += all_ranks_sum(trainer.datamodule.episodes(batch), pl_module.device)
            if self.episodes_done >= self.episodes:
                trainer.should_stop = True
        pl_module.log("step", float(pl_module.training_steps))  # Lightning's x for these: the steps done, as ours
        pl_module.log("phase/rl", float(self.phase == "rl"))
        pl_module.log("phase/demos", self.demos_done)
        pl_module.log("phase/episodes", self.episodes_done)
        pl_module.log("phase/cost", self.demos_done / self.sft_epochs * self.demo_cost + self.episodes_done)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.phase != "sft":
            return
        if self.demos_done < self.demos_to_serve:  # another (partial) pass over the demonstrations
            self.epoch_start_demos = self.demos_done
            trainer.datamodule.demo_rows = self.demos_to_serve - self.demos_done
            return
        self.phase = pl_module.phase = "rl"
        self.switched_at = {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
        pl_module.start_rl()  # a KL reference at rl_start takes the SFT weights
        if self.reset_optimizers:
            trainer.strategy.setup_optimizers(trainer)
        elif self.sft_learning_rate is not None:
            self._set_learning_rate(pl_module, pl_module.hparams.learning_rate)
        pl_module.log("phase/switch_epoch", float(trainer.current_epoch), **REDUCED)  # the same on every rank
        if trainer.is_global_zero:
            print(f"[phase] {self.describe()}", flush=True)
        for callback in trainer.callbacks:
            if isinstance(callback, HeldOutEvaluation):
                callback.evaluate(trainer, pl_module, "after SFT")
        if self.episodes == 0:
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.is_global_zero and (self.phase == "sft" or self.episodes_done < self.episodes):
            print(
                f"[phase] the run ended before its budget was spent ({self.describe()}): raise trainer.max_epochs "
                "(-1: until the budget is spent) or trainer.max_time",
                flush=True,
            )

    # ------------------------------------------------------------------ helpers
    @property
    def demos_to_serve(self) -> int:
        """Demonstrations the SFT phase serves, its passes included."""
        return self.demos * self.sft_epochs

    def describe(self) -> str:
        if self.phase == "sft":
            passes = f" x {self.sft_epochs} epochs" if self.sft_epochs > 1 else ""
            return (
                f"SFT: {self.demos_done:.0f} of {self.demos_to_serve} demonstrations ({self.demos}{passes}), then RL: "
                f"{self.episodes} episodes"
            )
        where = f" (switched at epoch {self.switched_at['epoch']})" if self.switched_at else ""
        return (
            f"RL: {self.episodes_done:.0f} of {self.episodes} episodes, after SFT on {self.demos} demonstrations"
            f"{f' x {self.sft_epochs} epochs' if self.sft_epochs > 1 else ''}{where}"
        )

    @staticmethod
    def _set_learning_rate(pl_module, value: float) -> None:
        optimizers = pl_module.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers[: len(pl_module.learners)]:  # the agents' (critics keep theirs)
            for group in optimizer.param_groups:
                group["lr"] = value
