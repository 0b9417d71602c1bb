"""Checkpoints counted in training steps (rollout batches) and written atomically.

Lightning's ``ModelCheckpoint(every_n_train_steps=...)`` counts ``global_step``, which here is one
per optimizer step: one per agent per update, and none for a step whose samples only wait in the
rollout buffer. This callback counts the steps the user set (``limit_train_batches``), saves
``last.ckpt`` beside a temporary file and renames it over the old one, so a run killed while saving
keeps its previous checkpoint. Under FSDP (``TeamFSDPStrategy``, ``save_distributed_checkpoint``)
the checkpoint is a folder of shards; it is swapped in with two renames, the previous one kept as
``last.ckpt.old`` in between (resume from that if a kill fell exactly there; a rank stopped because
another rank failed finishes the renames first). A single-file
checkpoint is flushed to disk before its rename and its SHA-256 recorded in ``last.ckpt.sha256``
(``lit_marl.checkpoint_files``): a damaged file is refused on resume. The checkpoint holds
what resuming needs beyond the weights and optimizers: the task position (the training loader's
state), the rollout buffers and the RNG states (see ``AgentTeamModule.on_save_checkpoint``).
Resume with ``lit-marl fit --config ... --ckpt_path <dirpath>/last.ckpt``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from lit_marl import checkpoint_files
from lit_marl.fields import PositiveInt, check_fields
from lit_marl.parallel import failure


class StepCheckpoint(Checkpoint):  # a Checkpoint: Lightning runs it after the other callbacks
    """Saves ``last.ckpt`` every ``every_n_steps`` training steps (rollout batches) and at each epoch's end,
    atomically (a run killed while saving keeps its previous checkpoint)."""

    def __init__(self, dirpath: str = "checkpoints", every_n_steps: PositiveInt = 1, filename: str = "last.ckpt"):
        """
        Args:
            dirpath: Folder of the checkpoint.
            every_n_steps: Save after every this many training steps (and at the end of each epoch,
                after the module has used what its rollout buffers held).
            filename: Name of the checkpoint file, replaced at each save.
        """
        check_fields("StepCheckpoint", StepCheckpoint.__init__, locals())
        self.path = Path(dirpath) / filename
        self.every_n_steps = every_n_steps

    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.world_size > 1:  # every rank writes shards there, a resume reads them all
            checkpoint_files.check_shared_folder(self.path.parent, trainer.strategy, "StepCheckpoint.dirpath")

    def save(self, trainer: L.Trainer) -> None:
        partial = self.path.with_name(self.path.name + ".partial")
        old = self.path.with_name(self.path.name + ".old")
        if trainer.is_global_zero and partial.is_dir():  # left by a run killed while saving
            shutil.rmtree(partial)
        trainer.strategy.barrier("StepCheckpoint")
        trainer.save_checkpoint(partial)  # every rank joins; rank 0 writes (under FSDP, every rank its shards)
        trainer.strategy.barrier("StepCheckpoint")
        # a rank stopped because another failed finishes these renames first (parallel/failure.py)
        with failure.critical():
            if trainer.is_global_zero:
                self.swap_in(partial, old)
        trainer.strategy.barrier("StepCheckpoint")

    def swap_in(self, partial: Path, old: Path) -> None:
        """``partial`` becomes the checkpoint (rank 0; no collective)."""
        if partial.is_dir():
            # a sharded checkpoint is a folder, which cannot replace another in one rename: the
            # previous one steps aside as .old until the new one is in place
            if self.path.exists():
                if old.exists():  # a kill fell after the last swap's renames, before .old was removed
                    shutil.rmtree(old)
                os.replace(self.path, old)
            os.replace(partial, self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            checkpoint_files.fsync_file(partial)  # on disk before it replaces the old one
            checkpoint_files.record(partial, self.path)
            os.replace(partial, self.path)
        checkpoint_files.fsync_dir(self.path.parent)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (trainer.fit_loop.total_batch_idx + 1) % self.every_n_steps == 0:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        self.save(trainer)
