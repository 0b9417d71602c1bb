from lit_marl.algorithms.magrpo import MAGRPO, MAREINFORCE, MARLOO, MAReMax

__all__ = ["MAGRPO", "MAREINFORCE", "MAReMax", "MARLOO"]
