from lit_marl.callbacks.checkpoint import StepCheckpoint
from lit_marl.callbacks.evaluation import HeldOutEvaluation
from lit_marl.callbacks.export import HFExport
from lit_marl.callbacks.initial_weights import InitialWeights
from lit_marl.callbacks.phase_switch import PhaseSwitch
from lit_marl.callbacks.progress import RunProgressBar

__all__ = ["HFExport", "HeldOutEvaluation", "InitialWeights", "PhaseSwitch", "RunProgressBar", "StepCheckpoint"]
