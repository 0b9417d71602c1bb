from lit_marl.callbacks.buffer_flush import BufferFlush
from lit_marl.callbacks.checkpoint import StepCheckpoint
from lit_marl.callbacks.evaluation import HeldOutEvaluation
from lit_marl.callbacks.export import HFExport

__all__ = ["BufferFlush", "HFExport", "HeldOutEvaluation", "StepCheckpoint"]
