"""Does anything grow per step? Trainer RSS over many training steps with the tiny model.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak_memory.py --steps 300 --algorithm magrpo

Trains MAGRPO (rollout buffers, two agents) or IAC (two turns, critic heads) on the slogan task for
``--steps`` steps (epochs cycle over the tasks), reading the process's resident memory after every
step. Prints RSS at a few points and the growth per 100 steps over the second half of the run
(after warm-up: allocator pools, compiled kernels and caches settle in the first steps). A bounded
run shows a growth near 0; a buffer or log that keeps every step would grow linearly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import IAC, MAGRPO  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Meter(L.Callback):
    def __init__(self):
        self.rss: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rss.append(rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--algorithm", choices=["magrpo", "iac"], default="magrpo")
    args = parser.parse_args()
    L.seed_everything(0)
    if args.algorithm == "magrpo":
        module = MAGRPO(model="tiny-random", learning_rate=1e-3, buffer={"size": 3})
        data = slogan_data(num_generations=2, sampling={"max_new_tokens": 12}, tasks_per_step=2)
    else:
        module = IAC(model="tiny-random", learning_rate=1e-3)
        data = slogan_data(
            num_generations=1,
            num_turns=2,
            transition="lit_marl.rollout.transitions:plain",
            sampling={"max_new_tokens": 12},
        )
    meter = Meter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(
            Path(tmp), max_epochs=-1, limit_train_batches=1.0, limit_val_batches=0, callbacks=[meter]
        )

        class Stop(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if len(meter.rss) >= args.steps:
                    trainer.should_stop = True

        trainer.callbacks.append(Stop())
        trainer.fit(module, datamodule=data)
    rss = meter.rss
    half = len(rss) // 2
    growth = (rss[-1] - rss[half]) / max(len(rss) - 1 - half, 1) * 100
    points = {str(i): round(rss[i - 1], 1) for i in (1, 10, half, len(rss)) if 1 <= i <= len(rss)}
    print(json.dumps({"algorithm": args.algorithm, "steps": len(rss), "rss_mb_at_step": points}))
    print(f"growth over the second half: {growth:+.2f} MB per 100 steps (max {max(rss):.0f} MB)")


if __name__ == "__main__":
    main()
