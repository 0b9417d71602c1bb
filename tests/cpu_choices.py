"""A callback for ``tests/fit/test_cpu_choices.py``: what a `lit-marl fit` process computes with,
read inside the process at the first training step, written as JSON to ``$CPU_CHOICES_OUT``."""

from __future__ import annotations

import json
import os

import torch
from lightning.pytorch.callbacks import Callback


class RecordChoices(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx:
            return
        with open(os.environ["CPU_CHOICES_OUT"], "w") as out:
            json.dump(
                {
                    "precision": str(trainer.precision),
                    "threads": torch.get_num_threads(),
                    "interop_threads": torch.get_num_interop_threads(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "autocast": type(trainer.precision_plugin).__name__ == "MixedPrecision",
                },
                out,
            )
