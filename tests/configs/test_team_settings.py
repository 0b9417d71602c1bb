"""Every algorithm takes the team settings of ``AgentTeamModule`` from a config: an algorithm that
lists its own arguments (the episode family does) must forward each, or ``model.<setting>`` is
refused for it (activation checkpointing was, for GRPO/RLOO/PPO, until this test)."""

from __future__ import annotations

import pytest
from jsonargparse import ArgumentParser

import lit_marl.algorithms as algorithms

TEAM_SETTINGS = {
    "memory",
    "attn_implementation",
    "weight_decay",
    "max_nonfinite_steps",
}


@pytest.mark.parametrize("name", algorithms.__all__)
def test_every_algorithm_takes_the_team_settings(name):
    parser = ArgumentParser()
    parser.add_class_arguments(getattr(algorithms, name), "model")
    accepted = {key.split(".")[0] for key in parser.get_defaults()["model"].keys()}
    assert TEAM_SETTINGS <= accepted, f"{name} lacks {sorted(TEAM_SETTINGS - accepted)}"
