"""Each agent saved as a standard Hugging Face folder, loadable with ``from_pretrained``.

At the end of fit (and whenever ``export(pl_module)`` is called) every distinct model of the team
is written to ``<dirpath>/agent<i>`` (``shared`` for a parameter-shared team) with its tokenizer and
chat template. A LoRA agent is either merged into its base weights (``lora: merged``, a plain
model) or saved as its adapter only (``lora: adapter``, loaded with peft on the base named in its
``adapter_config.json``). Critics and value heads are training machinery and stay in checkpoints.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

import lightning as L

from lit_marl.agents import AdapterView
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
        folders = []
        for index, roles in enumerate(pl_module.learners):
            agent = pl_module.agents[roles[0]]
            folder = self.dirpath / pl_module.learner_name(index)
            model = agent.model
            if pl_module.shards is not None:
                model = pl_module.shards.full_copy(model)  # None except on rank 0
            if not write:
                continue
            if isinstance(model, AdapterView):  # one adapter of a team's shared base
                if self.lora == "merged":
                    model.merged().save_pretrained(folder)
                else:
                    model.save_adapter(folder)
            else:
                if hasattr(model, "peft_config") and self.lora == "merged":
                    model = copy.deepcopy(model).merge_and_unload()  # the training copy keeps its adapter
                model.save_pretrained(folder)
            agent.tokenizer.save_pretrained(folder)
            folders.append(folder)
        return folders
