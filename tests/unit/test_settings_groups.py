"""The model's settings groups (``model.update``, ``model.buffer``, ``model.critic``): declared once,
passed whole from YAML and the command line, a field a family does not read refused, old flat keys
refused naming the new one, old checkpoints regrouped, and no setting name declared twice."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict

import pytest
import yaml

import lit_marl.algorithms as algorithms
from helpers import REPO_ROOT
from lit_marl import ConfigError
from lit_marl.algorithms import GRPO, IAC, MAAC, MAGRPO, PPO, RLOO
from lit_marl.algorithms.settings import BufferSettings, CriticSettings, UpdateSettings
from lit_marl.cli import build_cli
from lit_marl.fields import regroup_moved

GROUPS = {"update", "advantage", "kl", "buffer", "critic", "pairs", "lora"}
"""Group parameters: each family that reads a group declares it (its fields are declared once)."""


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: MAGRPO(update={"dual_clip": 2.0}), "model.update.dual_clip=2.0: MAGRPO does not read it"),
        (lambda: GRPO(update={"entropy_coef": 0.1}), "model.update.entropy_coef=0.1: GRPO does not read it"),
        (lambda: PPO(critic={"type": "q"}), "model.critic.type='q': PPO does not read it"),
        (lambda: IAC(critic={"warmup": 2}), "model.critic.warmup=2: IAC does not read it"),
        (lambda: MAAC(critic={"kind": "head"}), "model.critic.kind=head: the centralized critic of MAAC"),
        (lambda: PPO(update={"clip_range": 1.5}), "model.update.clip_range=1.5: must be > 0 and < 1"),
        (lambda: MAGRPO(buffer={"size": 0}), "model.buffer.size=0: must be > 0"),
        (lambda: PPO(advantage={"turn_level": True}), "model.advantage.turn_level=True: PPO does not read it"),
        (lambda: GRPO(advantage={"gae": "turn"}), "model.advantage.gae='turn': GRPO does not read it"),
        (lambda: IAC(advantage={"mode": "max"}), "model.advantage.mode='max': IAC does not read it"),
        (lambda: MAGRPO(kl={"mode": "reward"}), "model.kl.mode='reward': MAGRPO does not read it (it reads coef)"),
        (lambda: MAGRPO(advantage={"gae_lambda": 1.5}), "model.advantage.gae_lambda=1.5: must be >= 0 and <= 1"),
    ],
)
def test_a_field_the_family_does_not_read_is_refused(build, message, no_model_loads):
    with pytest.raises(ConfigError) as err:
        build()
    assert message in str(err.value)
    assert no_model_loads == []


def test_groups_come_whole_from_yaml_and_the_command_line(in_repo_root, tmp_path, no_model_loads):
    """A config's group, a command-line field on top; the module holds the dataclass and its
    saved hyperparameters plain values (checkpoints load ``weights_only``)."""
    config = yaml.safe_load((REPO_ROOT / "configs/ppo/corridor_tiny.yaml").read_text())
    config["model"]["init_args"]["update"] = {"ppo_epochs": 3}
    config["model"]["init_args"]["critic"] = {"warmup": 1}
    path = tmp_path / "grouped.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = build_cli(args=["--config", str(path), "--model.update.clip_range", "0.1"], run=False)
    assert cli.model.update == UpdateSettings(ppo_epochs=3, clip_range=0.1)
    assert cli.model.critic == CriticSettings(warmup=1) and cli.model.critic_kind == "head"
    assert cli.model.hparams["update"] == {**vars(UpdateSettings(ppo_epochs=3, clip_range=0.1))}
    with pytest.raises(ConfigError, match=r"model.ppo_epochs \(in the command line\) is now model.update.ppo_epochs"):
        build_cli(args=["--config", str(path), "--model.ppo_epochs=2"], run=False)
    config["model"]["init_args"]["critic"] = "model"  # the old flat key, its value a kind
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"model.critic \(in .*grouped.yaml\) is now model.critic.kind"):
        build_cli(args=["--config", str(path)], run=False)
    assert no_model_loads == []


def test_a_checkpoint_saved_before_the_move_is_regrouped():
    saved = {
        "model": "tiny-random",
        "critic": "model",
        "critic_learning_rate": 1e-3,
        "ppo_epochs": 2,
        "policy_loss": "ppo",
    }
    saved |= {"rollout_buffer_size": 4, "update_schedule": "per_turn", "advantage_normalization": False}
    assert regroup_moved("model", saved) == {
        "model": "tiny-random",
        "policy_loss": "ppo",
        "critic": {"kind": "model", "learning_rate": 1e-3},
        "update": {"ppo_epochs": 2},
        "buffer": {"size": 4, "schedule": "per_turn"},
        "advantage": {"normalization": False},
    }
    assert IAC(**regroup_moved("model", saved)).buffer == BufferSettings(4, "per_turn")


def test_advantage_normalization_defaults_to_each_familys_own(no_model_loads):
    """One default (None) for every family: on, but off for RLOO, whose leave-one-out baseline is
    the unbiased estimator only unscaled; an explicit value wins in both."""
    assert GRPO().advantage.normalized(GRPO.normalizes) and not RLOO().advantage.normalized(RLOO.normalizes)
    assert RLOO(advantage={"normalization": True}).advantage.normalized(RLOO.normalizes)
    assert not GRPO(advantage={"normalization": False}).advantage.normalized(GRPO.normalizes)
    assert PPO().advantage.normalized() and MAGRPO().advantage.normalized() and IAC().advantage.normalized()


def test_no_setting_is_declared_by_two_algorithm_classes():
    """A setting name in the signatures of two classes of ``lit_marl.algorithms`` is declared twice,
    possibly with two defaults: it belongs in a group (or the base)."""
    where = defaultdict(list)
    for info in pkgutil.walk_packages(algorithms.__path__, "lit_marl.algorithms."):
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__ and "__init__" in cls.__dict__:
                if not hasattr(cls, "configure_optimizers"):
                    continue  # rows and heads, not algorithms
                for param in list(inspect.signature(cls.__dict__["__init__"]).parameters)[1:]:
                    if param not in ("kwargs", "args"):
                        where[param].append(name)
    shared = {p: classes for p, classes in where.items() if len(classes) > 1 and p not in GROUPS}
    assert shared == {}, shared
