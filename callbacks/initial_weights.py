"""A new run that starts from the weights of an earlier one.

``InitialWeights(path)`` loads, when a fit starts, each agent's LoRA adapter from the folder an
earlier run's ``HFExport(lora: adapter)`` wrote (``team.json`` says which folder plays each role):
e.g. RL from an SFT run, several RL runs from one SFT run. A run resumed from its checkpoint keeps
the checkpoint's weights. A merged export is a plain model: give it as ``model.model`` instead.
"""

from __future__ import annotations

import lightning as L

from lit_marl.export import load_adapters
from lit_marl.fields import check_fields


class InitialWeights(L.Callback):
    """Starts a new run from an earlier run's exported LoRA adapters (``HFExport(lora: adapter)``)."""

    def __init__(self, path: str):
        """
        Args:
            path: The export folder of the earlier run (its ``team.json`` and one folder per model).
        """
        check_fields("InitialWeights", InitialWeights.__init__, locals())
        self.path = path

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.ckpt_path is None:  # resumed: the checkpoint holds the run's own weights
            load_adapters(pl_module, self.path)
