from lit_marl.callbacks.checkpoint import StepCheckpoint
from lit_marl.callbacks.evaluation import HeldOutEvaluation
from lit_marl.callbacks.export import HFExport
from lit_marl.callbacks.phase_switch import PhaseSwitch
from lit_marl.callbacks.progress import RunProgressBar

__all__ = ["HFExport", "HeldOutEvaluation", "PhaseSwitch", "RunProgressBar", "StepCheckpoint"]
