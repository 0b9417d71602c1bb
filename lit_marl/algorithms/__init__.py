from lit_marl.algorithms.grpo import GRPO, RLOO
from lit_marl.algorithms.iac import IAC
from lit_marl.algorithms.maac import MAAC
from lit_marl.algorithms.magrpo import MAGRPO, MAREINFORCE, MARLOO, MAReMax
from lit_marl.algorithms.ppo import PPO
from lit_marl.algorithms.sft import SFT

__all__ = ["GRPO", "IAC", "MAAC", "MAGRPO", "MAREINFORCE", "MAReMax", "MARLOO", "PPO", "RLOO", "SFT"]
