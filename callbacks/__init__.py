from lit_marl.callbacks.evaluation import HeldOutEvaluation

__all__ = ["HeldOutEvaluation"]
