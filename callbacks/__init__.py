from lit_marl.callbacks.buffer_flush import BufferFlush
from lit_marl.callbacks.checkpoint import StepCheckpoint
from lit_marl.callbacks.evaluation import HeldOutEvaluation

__all__ = ["BufferFlush", "HeldOutEvaluation", "StepCheckpoint"]
