"""Each agent saved as a standard Hugging Face folder, loadable with ``from_pretrained``.

At the end of fit (and whenever ``export(pl_module)`` is called) every distinct model of the team
is written to ``<dirpath>/agent<i>`` (``shared`` for a parameter-shared team) with its tokenizer and
chat template, and ``<dirpath>/team.json`` says which folder plays each role. A LoRA agent is
either merged into its base weights (``lora: merged``, a plain model) or saved as its adapter only
(``lora: adapter``, loaded with peft on the base named in its ``adapter_config.json``). Critics and
value heads are training machinery and stay in checkpoints. ``lit-marl export`` writes the same
folders from a checkpoint (``lit_marl/export.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import lightning as L

from lit_marl.export import export_team
from lit_marl.fields import check_fields


class HFExport(L.Callback):
    """At the end of fit, writes each distinct model of the team as a Hugging Face folder with its tokenizer."""

    def __init__(self, dirpath: str = "export", lora: Literal["merged", "adapter"] = "merged"):
        """
        Args:
            dirpath: Folder that receives one subfolder per agent (``agent0``, ``agent1``, ... or ``shared``).
            lora: For LoRA agents: ``merged`` writes the base with the adapter merged in; ``adapter``
                writes the adapter only.
        """
        check_fields("HFExport", HFExport.__init__, locals())
        self.dirpath, self.lora = Path(dirpath), lora

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self.export(pl_module, write=trainer.is_global_zero)
        trainer.strategy.barrier("HFExport")

    def export(self, pl_module, write: bool = True) -> list[Path]:
        """Write every agent now (under FSDP every rank must call this: the weights are gathered;
        ``write`` on one rank); returns the folders."""
        return export_team(pl_module, self.dirpath, self.lora, write)
