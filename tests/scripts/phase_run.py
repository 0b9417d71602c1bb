"""One SFT -> PPO run on the Corridor game for the phase-switch tests, in its own process so that it
can be SIGKILLed.

python phase_run.py OUT [--kill-before K] [--resume CKPT]

Budget: 12 demonstrations (3 SFT steps of 4) + 16 episodes (4 PPO steps of 4 tasks). Appends one
line per training step to OUT/steps.jsonl (the module's phase, the callback's counters, the rows
of the step) and, when the run finishes, writes OUT/params.pt and OUT/phase.json (the callback's
final state). --kill-before K: SIGKILL when training step K (0-based) is about to start, after the
checkpoint of step K-1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from helpers import REPO_ROOT, make_trainer  # noqa: E402
from lit_marl.algorithms import PPO  # noqa: E402
from lit_marl.callbacks import PhaseSwitch, StepCheckpoint  # noqa: E402
from lit_marl.data import EpisodeDataModule  # noqa: E402


class Recorder(L.Callback):
    def __init__(self, out: Path, kill_before: int | None, switch: PhaseSwitch):
        self.out, self.kill_before, self.switch = out, kill_before, switch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill_before is not None and trainer.fit_loop.total_batch_idx == self.kill_before:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {
            "phase": pl_module.phase,
            "demos_done": self.switch.demos_done,
            "episodes_done": self.switch.episodes_done,
            "epoch": trainer.current_epoch,
            "loss": float(trainer.callback_metrics.get("train/sft_loss" if pl_module.phase == "sft" else "train/loss")),
            "rows": trainer.datamodule.current_rows,
        }
        with open(self.out / "steps.jsonl", "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")


class RecordingData(EpisodeDataModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            self.current_rows = [row["task_id"] for row in batch]
        return super().on_before_batch_transfer(batch, dataloader_idx)


def demo_file(demos: Path, args) -> str:
    """The demonstrations; for several SFT epochs exactly the budget's 12 (the first 12 rows)."""
    if args.sft_epochs == 1:
        return str(demos)
    out = args.out / "demos12.jsonl"
    out.write_text("".join(demos.read_text().splitlines(keepends=True)[:12]))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-before", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--sft-epochs", type=int, default=1, help="above 1: on the first 12 demonstrations only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    corridor = REPO_ROOT / "data" / "corridor"
    module = PPO(model="tiny-random", learning_rate=1e-3, advantage={"gae": "turn"})
    data = RecordingData(
        train_path=str(corridor / "train.jsonl"),
        env="corridor",
        demos={"path": demo_file(corridor / "demos.jsonl", args), "batch_size": 4},
        tasks_per_step=4,
        num_generations=1,
        max_turns=3,
        sampling={"max_new_tokens": 6},
        env_workers=1,
    )
    switch = PhaseSwitch(budget=28, split="12:16", sft_learning_rate=3e-3, sft_epochs=args.sft_epochs)
    trainer = make_trainer(
        args.out,
        logger=False,
        max_epochs=-1,
        limit_train_batches=None,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[switch, Recorder(args.out, args.kill_before, switch), StepCheckpoint(str(args.out / "checkpoints"))],
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    torch.save({n: p.detach().clone() for n, p in module.named_parameters()}, args.out / "params.pt")
    (args.out / "phase.json").write_text(json.dumps(switch.state_dict()))


if __name__ == "__main__":
    main()
