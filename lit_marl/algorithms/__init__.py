from lit_marl.algorithms.grpo import GRPO, RLOO
from lit_marl.algorithms.iac import IAC
from lit_marl.algorithms.iterative import IterativeMADPO
from lit_marl.algorithms.maac import MAAC
from lit_marl.algorithms.madpo import MADPO
from lit_marl.algorithms.magrpo import MAGRPO, MAREINFORCE, MARLOO, CentralizedMAGRPO, MAReMax
from lit_marl.algorithms.marlhf import RewardModelFit
from lit_marl.algorithms.ppo import PPO
from lit_marl.algorithms.sft import SFT

__all__ = [
    "CentralizedMAGRPO",
    "GRPO",
    "IAC",
    "IterativeMADPO",
    "MAAC",
    "MADPO",
    "MAGRPO",
    "MAREINFORCE",
    "MAReMax",
    "MARLOO",
    "PPO",
    "RLOO",
    "RewardModelFit",
    "SFT",
]
