"""Cooperative code generation: tasks, sandboxed per-test execution, level-based reward, feedback."""

from lit_marl.envs.code.env import CodeEnv, RewardWeights, Role
from lit_marl.envs.code.execution import ExecReport, TestCase, TestLimits, TestOutcome, run_tests, split_tests
from lit_marl.envs.code.expert import Expert
from lit_marl.envs.code.problems import load_problems
from lit_marl.envs.code.program import extract_code

__all__ = [
    "CodeEnv",
    "ExecReport",
    "Expert",
    "RewardWeights",
    "Role",
    "TestCase",
    "TestLimits",
    "TestOutcome",
    "extract_code",
    "load_problems",
    "run_tests",
    "split_tests",
]
