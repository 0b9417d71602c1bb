"""Uses what is left in the rollout buffers at the end of every training epoch, so no sample is
dropped when the epoch ends before a buffer fills (MAGRPO adds it by itself)."""

from __future__ import annotations

import lightning as L


class BufferFlush(L.Callback):
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module) -> None:
        with pl_module.gathered():
            pl_module.flush_buffers()
