"""Every shipped config parses, and instantiating one loads data but no model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO_ROOT
from lit_marl import ConfigError
from lit_marl.algorithms import base as base_module
from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.cli import build_cli
from lit_marl.data import RolloutDataModule, TaskDataModule

# whole runs; configs/comlrl/ holds presets that go after one (test_comlrl_parity.py)
# comlrl/: CoMLRL's own configs; scale/: GPU-only (vLLM, a hub model, 8 GPUs, official ALFWorld data), built
# with a tiny stand-in in tests/unit/test_scale_configs.py
CONFIGS = sorted(
    p.relative_to(REPO_ROOT).as_posix()
    for p in (REPO_ROOT / "configs").rglob("*.yaml")
    if p.parent.name not in ("comlrl", "scale")
)


def test_configs_are_found():
    assert "configs/quickstart.yaml" in CONFIGS
    assert "configs/magrpo/slogan_tiny.yaml" in CONFIGS


@pytest.mark.parametrize("config", CONFIGS)
def test_config_prints(config, in_repo_root, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(args=["fit", "--config", config, "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "model:" in out
    printed = yaml.safe_load(out)
    source = yaml.safe_load((REPO_ROOT / config).read_text())
    assert printed["model"]["class_path"] == source["model"]["class_path"]
    assert printed["data"]["class_path"] == source["data"]["class_path"]
    data, printed_data = source["data"]["init_args"], printed["data"]["init_args"]
    if "agent_prompts" in data:
        assert printed_data["agent_prompts"] == data["agent_prompts"]
    elif isinstance(data.get("env"), dict):  # an environment gives the prompts
        assert printed_data["env"]["class_path"] == data["env"]["class_path"]
    # the number of agents is linked to the prompts at instantiation, so it is not a config key
    assert "num_agents" not in printed["model"]["init_args"]


def small_game_sets(config: str) -> list[str]:
    """Overrides that shrink a config's named game sets to one game (per task type): resolving
    them is what is tested; generating 64 TextWorld games and their walkthroughs is the cost of a
    run, not of this check (it took 100-170 s a config). The PyPI SWE set is built once by a script
    (an hour, with downloads): its configs resolve the bundled SWE instances in its place."""
    data = yaml.safe_load((REPO_ROOT / config).read_text())["data"]["init_args"]
    out = []
    sources = {"train_path": data.get("train_path"), "val_path": data.get("val_path")}
    sources["demos.path"] = (data.get("demos") or {}).get("path")
    for key, source in sources.items():
        source = source or ""
        if source.startswith(("textworld:", "alfworld:")) and source.rsplit(":", 1)[-1].isdigit():
            out += [f"--data.{key}", source.rsplit(":", 1)[0] + ":1"]
        if source.startswith("swe:pypi:"):
            out += [f"--data.{key}", "swe:bundled:" + source.split(":")[2]]
    if "--data.demos.path" in out and data.get("env") == "swe":  # bundled fixes have 2 hunks: 2 views, 2 edits
        out += ["--data.env_kwargs", json.dumps({**data["env_kwargs"], "max_steps": 6})]
    return out


def test_a_pypi_swe_config_without_the_built_set_names_the_script(in_repo_root, monkeypatch, tmp_path):
    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="make_swe_pypi.py"):
        build_cli(args=["--config", "configs/swe/sft_grpo_pypi.yaml"], run=False)


def test_small_game_sets_keep_the_set_and_shrink_the_count():
    assert small_game_sets("configs/textworld/sft_ppo_cpu.yaml") == [
        "--data.train_path", "textworld:w2-o3-q4:train:1",
        "--data.val_path", "textworld:w2-o3-q4:test:1",
        "--data.demos.path", "textworld:w2-o3-q4:validation:1",
    ]  # fmt: skip
    assert small_game_sets("configs/quickstart.yaml") == []


@pytest.mark.parametrize("config", CONFIGS)
def test_config_instantiates_without_loading_models(config, in_repo_root, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("instantiating a config must not load a model")

    monkeypatch.setattr(base_module, "Agent", refuse)
    cli = build_cli(args=["--config", config, *small_game_sets(config)], run=False)
    source = yaml.safe_load((REPO_ROOT / config).read_text())
    assert isinstance(cli.model, AgentTeamModule)
    assert isinstance(cli.datamodule, TaskDataModule)
    assert cli.model.agents is None
    data = source["data"]["init_args"]
    if "centralized_adapter" in data:  # one joint actor plays every role
        agents = 1
    elif "agent_prompts" in data:
        agents = len(data["agent_prompts"])
    else:
        agents = cli.datamodule.env.num_agents  # data.env: the environment, in every data module
    assert cli.model.hparams.num_agents == cli.datamodule.num_agents == agents
    assert cli.model.sources == [source["model"]["init_args"]["model"]] * cli.datamodule.num_agents
    assert len(cli.datamodule.train_tasks) > 0
    if "val_path" in source["data"]["init_args"]:
        assert len(cli.datamodule.val_tasks) > 0
    if isinstance(cli.datamodule, RolloutDataModule):  # a prompt per agent for every train row
        prompts = cli.datamodule.prompts_for(cli.datamodule.train_tasks)
        assert all(len(p) == cli.datamodule.num_agents for p in prompts)
        if "agent_prompts" in data:  # ... and every row fills every template (code prompts hold braces)
            assert all("{" not in "".join(p) for p in prompts)
    callbacks = {type(c).__name__ for c in cli.trainer.callbacks}
    for entry in source["trainer"].get("callbacks", []):
        assert entry["class_path"].rsplit(".", 1)[-1] in callbacks


def test_unknown_option_is_rejected(in_repo_root, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(args=["fit", "--config", "configs/magrpo/slogan_tiny.yaml", "--data.num_generaitons", "2"])
    assert exit_info.value.code != 0
    assert "num_generaitons" in capsys.readouterr().err


def test_console_script(repo_root):
    """`lit-marl`, the command the README and Makefile use, is installed and reads the configs; its
    start-up imports no logger's package (wandb, mlflow: only when that logger is used)."""
    script = Path(sys.executable).parent / "lit-marl"
    if not script.exists():
        pytest.skip("the package is not installed in this environment (pip install -e .)")
    result = subprocess.run(
        [str(script), "fit", "--config", "configs/quickstart.yaml", "--print_config"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert yaml.safe_load(result.stdout)["model"]["init_args"]["model"] == "smollm2-135m-instruct"
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines}
    assert "lit_marl" in imported and not imported & {"wandb", "mlflow", "markdown"}


def test_cli_validate(in_repo_root, tmp_path):
    cli = build_cli(
        args=[
            "validate",
            "--config",
            "configs/magrpo/slogan_tiny.yaml",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--data.sampling.max_new_tokens",
            "4",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert {"val/reward", "val/success"} <= set(metrics)
    assert 0.0 <= float(metrics["val/reward"]) <= 1.0


def test_readme_validate_command_reports_metrics(in_repo_root, tmp_path):
    """README: `lit-marl validate --config configs/quickstart.yaml  # greedy held-out metrics`.
    (The model is swapped for the tiny one to keep this fast; the rest of the config is as shipped.)"""
    cli = build_cli(
        args=[
            "validate",
            "--config",
            "configs/quickstart.yaml",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            "--model.init_args.model",
            "tiny-random",
            "--data.sampling.max_new_tokens",
            "2",
        ]
    )
    assert "val/reward" in cli.trainer.callback_metrics, "validate ran no held-out batch"


@pytest.mark.parametrize(
    "base, preset",
    [
        ("configs/magrpo/slogan_tiny_2turn.yaml", "configs/comlrl/magrpo.yaml"),
        ("configs/iac/slogan_tiny_2turn.yaml", "configs/comlrl/iac.yaml"),
        ("configs/maac/slogan_tiny_2turn.yaml", "configs/comlrl/maac.yaml"),
    ],
)
def test_comlrl_presets_go_after_a_config(base, preset, in_repo_root, monkeypatch):
    """A preset sets CoMLRL's behaviour on top of a run's config and keeps the run's own settings."""
    monkeypatch.setattr(base_module, "Agent", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no loads")))
    cli = build_cli(args=["--config", base, "--config", preset], run=False)
    wanted = yaml.safe_load((REPO_ROOT / preset).read_text())
    for key, value in wanted["model"]["init_args"].items():
        got = getattr(cli.model, key, cli.model.hparams.get(key))
        if isinstance(value, dict):  # a group: the preset's fields set
            got = {k: getattr(got, k) for k in value}
        assert got == value, key
    tree = cli.datamodule.tree
    for key, value in wanted["data"]["init_args"].items():
        if isinstance(value, dict):  # a group: the preset's fields set, the config's others kept
            assert {k: getattr(getattr(tree, key), k) for k in value} == value, key
        else:
            assert getattr(tree, key) == value, key
    source = yaml.safe_load((REPO_ROOT / base).read_text())
    assert cli.model.sources[0] == source["model"]["init_args"]["model"]
    assert tree.num_turns == source["data"]["init_args"]["num_turns"]
    assert tree.sampling.max_new_tokens == source["data"]["init_args"]["sampling"]["max_new_tokens"]  # the run's own


def test_help_lists_every_command_and_predict_is_refused_by_name(in_repo_root, monkeypatch, capsys):
    """`predict` crashed (the algorithms have no forward pass) and `plot` was missing from --help."""
    from lit_marl.cli import COMMANDS, main

    with pytest.raises(SystemExit):
        build_cli(args=["--help"])
    listed = capsys.readouterr().out
    for name, (*_, description) in COMMANDS.items():
        assert f"    {name} " in listed and description.split(" (")[0] in listed
    assert "predict" not in listed
    monkeypatch.setattr(sys, "argv", ["lit-marl", "predict", "--config", "configs/magrpo/slogan_tiny.yaml"])
    with pytest.raises(SystemExit) as refused:
        main()
    assert "no `predict`" in str(refused.value.code) and "lit-marl chat" in str(refused.value.code)
    assert "\n" not in str(refused.value.code)


def test_another_algorithm_on_the_command_line_gets_its_own_defaults(in_repo_root, tmp_path, no_model_loads):
    """`--model RLOO` on a GRPO config: a setting the config does not give takes RLOO's own meaning
    (``advantage.normalization: null``: unscaled); one the config gives is kept. No setting's default
    differs between two families (``test_no_setting_is_declared_by_two_algorithm_classes``), so a kept
    setting never means something else in the new class."""
    base = ["--config", "configs/grpo/corridor_tiny.yaml", "--trainer.logger", "false"]
    cli = build_cli(args=[*base, "--model", "lit_marl.algorithms.RLOO"], run=False)
    assert type(cli.model).__name__ == "RLOO" and not cli.model.advantage.normalized(cli.model.normalizes)
    assert cli.model.hparams.learning_rate == 1.0e-3  # the config's
    cli = build_cli(args=[*base, "--model", "RLOO", "--model.advantage.normalization", "true"], run=False)
    assert cli.model.advantage.normalized(cli.model.normalizes)


def test_a_later_config_that_replaces_a_setting_says_so(in_repo_root, tmp_path, monkeypatch, capsys):
    """A parity preset after a ported script's config replaces its explicit early-termination setting:
    lit-marl names the key, both values and both files; in the other order the script's value wins."""
    monkeypatch.setattr(base_module, "Agent", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no loads")))
    mine = tmp_path / "port.yaml"
    base = yaml.safe_load((REPO_ROOT / "configs/iac/slogan_tiny_2turn.yaml").read_text())
    base["data"]["init_args"]["early_termination_threshold"] = None
    mine.write_text(yaml.safe_dump(base))
    cli = build_cli(args=["--config", str(mine), "--config", "configs/comlrl/iac.yaml"], run=False)
    err = capsys.readouterr().err
    assert cli.datamodule.tree.early_termination_threshold == -0.2
    said = f"data.init_args.early_termination_threshold=-0.2 from configs/comlrl/iac.yaml replaces None from {mine}"
    assert said in err
    cli = build_cli(args=["--config", "configs/comlrl/iac.yaml", "--config", str(mine)], run=False)
    assert cli.datamodule.tree.early_termination_threshold is None and cli.datamodule.tree.chat_template is False
    assert f"early_termination_threshold=None from {mine} replaces -0.2" in capsys.readouterr().err


def test_a_settings_group_comes_whole_from_yaml_and_old_keys_name_the_new_one(in_repo_root, tmp_path, monkeypatch):
    """``data.reward_calls`` from YAML and the command line; a key from before the move (YAML or the
    command line) stops naming the new key; a checkpoint saved before the move is regrouped."""
    from lit_marl.envs.calls import CallSettings
    from lit_marl.fields import regroup_moved

    monkeypatch.setattr(base_module, "Agent", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no loads")))
    config = yaml.safe_load((REPO_ROOT / "configs/magrpo/slogan_tiny.yaml").read_text())
    config["data"]["init_args"]["reward_calls"] = {"on_reward_error": "skip", "reward_timeout_s": 30}
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text(yaml.safe_dump(config))
    args = ["--config", str(grouped), "--data.reward_calls.max_skipped_steps", "5"]
    cli = build_cli(args=args, run=False)
    assert cli.datamodule.call_settings == CallSettings("skip", 30.0, 600.0, "prompt", 5)
    assert cli.datamodule.env.call_settings is cli.datamodule.call_settings
    del config["data"]["init_args"]["reward_calls"]
    config["data"]["init_args"]["on_reward_error"] = "skip"
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    with pytest.raises(
        ConfigError, match=r"data.on_reward_error \(in .*old.yaml\) is now data.reward_calls.on_reward_error"
    ):
        build_cli(args=["--config", str(old)], run=False)
    with pytest.raises(ConfigError, match=r"data.max_skipped_steps \(in the command line\) is now data.reward_calls"):
        build_cli(args=["--config", str(grouped), "--data.max_skipped_steps=5"], run=False)
    saved = {"env": "slogan", "on_reward_error": "skip", "transition_prompt_field": "task"}
    assert regroup_moved("data", saved) == {
        "env": "slogan",
        "reward_calls": {"on_reward_error": "skip", "transition_prompt_field": "task"},
    }


def test_the_sampling_group_reaches_the_rollouts_whole_and_old_configs_migrate(in_repo_root, tmp_path, monkeypatch):
    """``data.sampling`` from YAML and the command line is one object the tree settings hold (what
    every engine call gets); an old flat key stops naming its group; ``scripts/migrate_config.py``
    rewrites an old file (comments kept) into one that builds the same group."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import migrate_config

    from lit_marl.fields import current_key, pre_move_key, regroup_moved, ungroup_moved
    from lit_marl.generation import Sampling

    monkeypatch.setattr(base_module, "Agent", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no loads")))
    cli = build_cli(args=["--config", "configs/magrpo/slogan_tiny.yaml", "--data.sampling.top_k", "5"], run=False)
    assert cli.datamodule.tree.sampling is cli.datamodule.sampling
    assert cli.datamodule.sampling == Sampling(max_new_tokens=16, top_k=5)
    with pytest.raises(ConfigError, match=r"data.temperature \(in the command line\) is now data.sampling.temperature"):
        build_cli(args=["--config", "configs/magrpo/slogan_tiny.yaml", "--data.temperature=0.5"], run=False)
    old = tmp_path / "old.yaml"
    old.write_text(
        "data:\n  class_path: lit_marl.data.RolloutDataModule\n  init_args:\n    max_new_tokens: 12  # a short reply\n"
        "    tasks_per_step: 2\n    temperature: 0.5\n"
    )
    assert migrate_config.main(["--check", str(old)]) == 1
    assert migrate_config.main([str(old)]) == 0 and migrate_config.main(["--check", str(old)]) == 0
    new = old.read_text()
    assert "      max_new_tokens: 12  # a short reply\n" in new and "    sampling:\n" in new
    assert yaml.safe_load(new)["data"]["init_args"] == {
        "sampling": {"max_new_tokens": 12, "temperature": 0.5},
        "tasks_per_step": 2,
    }
    saved = {"env": "slogan", "top_k": 3, "on_reward_error": "skip"}
    assert ungroup_moved("data", regroup_moved("data", saved)) == saved
    assert current_key("data.init_args.top_k") == "data.init_args.sampling.top_k"
    assert pre_move_key("data.init_args.sampling.top_k") == "data.init_args.top_k"
    assert current_key("model.init_args.learning_rate") == pre_move_key("model.init_args.learning_rate")
