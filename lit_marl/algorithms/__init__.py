from lit_marl.algorithms.magrpo import MAGRPO

__all__ = ["MAGRPO"]
