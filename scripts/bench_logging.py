"""What logging a step's diagnostics costs: Lightning's ``self.log`` per key vs lit_marl's StepLog
(records into a dict, one reduce, one write to the logger), in a real Trainer loop.

    .venv/bin/python scripts/bench_logging.py                    # 30 keys, 300 steps, TensorBoard + none
    .venv/bin/python scripts/bench_logging.py --keys 10 30 60 --steps 500

A step does nothing but log, so its time is the logging's (plus the loop's own, measured by the
``none`` mode that logs nothing). The modes alternate within each repeat; the figures are medians of
the per-step wall times. Prints one line per configuration and a final JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lit_marl.metrics import StepLog


class Probe(L.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.ends.append(time.perf_counter())


class Logs(L.LightningModule):
    def __init__(self, mode: str, keys: int) -> None:
        super().__init__()
        self.mode, self.keys = mode, keys
        self.layer = torch.nn.Linear(1, 1)
        self.automatic_optimization = False
        self.step_log = StepLog()

    def training_step(self, batch, batch_idx: int) -> None:
        values = {f"group{k % 5}/key{k}": float(batch_idx + k) for k in range(self.keys)}
        if self.mode == "self.log":
            for key, value in values.items():
                self.log(key, value, batch_size=1)
        elif self.mode == "StepLog":
            self.step_log.add(values)
            self.step_log.write(self.trainer, batch_idx + 1, False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def run(mode: str, keys: int, steps: int, logger: str) -> float:
    probe = Probe()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=1,
            limit_train_batches=steps,
            logger=TensorBoardLogger(tmp) if logger == "tensorboard" else False,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[probe],
        )
        data = torch.utils.data.DataLoader(torch.zeros(steps, 1), batch_size=1)
        trainer.fit(Logs(mode, keys), train_dataloaders=data)
    gaps = [b - a for a, b in zip(probe.ends, probe.ends[1:])][10:]  # after a warm-up
    return statistics.median(gaps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[30])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logger", nargs="+", default=["tensorboard", "none"], choices=["tensorboard", "none"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for logger in args.logger:
        for keys in args.keys:
            times: dict[str, list[float]] = {"none": [], "self.log": [], "StepLog": []}
            for _ in range(args.repeats):
                for mode in times:
                    times[mode].append(run(mode, keys, args.steps, logger))
            ms = {mode: statistics.median(values) for mode, values in times.items()}
            cost = {mode: ms[mode] - ms["none"] for mode in ("self.log", "StepLog")}
            print(
                f"logger={logger:11} keys={keys:3}: loop {ms['none']:.3f} ms/step; logging: self.log "
                f"{cost['self.log']:.3f} ms/step ({cost['self.log'] / keys:.3f} ms/key), StepLog "
                f"{cost['StepLog']:.3f} ms/step ({cost['StepLog'] / keys:.4f} ms/key)",
                flush=True,
            )
            results.append({"logger": logger, "keys": keys, "ms_per_step": ms, "logging_ms_per_step": cost})
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "results": results}))


if __name__ == "__main__":
    main()
