"""configs/scale: the guide's experiments at Qwen2.5-1.5B, 7B and 14B on 8 GPUs (and 2 nodes with
two_nodes.yaml). They cannot run here; each must parse and build its modules on this CPU with the
tiny model standing in, keep the settings that make it fit (bf16, FSDP2 - per layer from 7B -,
checkpointing, vLLM), and carry the memory plan of its header as scripts/plan_memory.py computes it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_marl.cli import build_cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "scale").glob("*_qwen*.yaml"))
MODELS = {
    "1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "7b": "Qwen/Qwen2.5-7B-Instruct",
    "14b": "Qwen/Qwen2.5-14B-Instruct",
    "32b": "Qwen/Qwen2.5-32B-Instruct",
}
SERVED = {"textworld_grpo_qwen32b.yaml"}  # rollouts on a vLLM server node, the trainer on 2 nodes
SMALL = {
    "textworld": [
        "--data.init_args.train_path=textworld:w2-o3-q4:train:2",
        "--data.init_args.val_path=textworld:w2-o3-q4:test:1",
    ],
    "alfworld": ["--data.init_args.train_path=alfworld:train:1", "--data.init_args.val_path=alfworld:test:1"],
}


def _stand_in(config: Path, *overlays: str) -> list[str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    from plan_memory import stand_in_args

    configs = [str(config)] + [str(ROOT / "configs" / "scale" / overlay) for overlay in overlays]
    return stand_in_args(configs, "tiny-random") + SMALL[config.name.split("_")[0]]


def test_there_is_a_config_per_env_and_algorithm():
    small = {f"{e}_{a}_qwen1.5b.yaml" for e in SMALL for a in ("ppo", "grpo", "rloo")}
    large = {"textworld_grpo_qwen7b.yaml", "textworld_ppo_qwen7b.yaml", "textworld_grpo_qwen14b.yaml"}
    assert {c.name for c in CONFIGS} == small | large | SERVED


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_scale_config_builds_with_a_tiny_stand_in(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(config.read_text())
    assert raw["model"]["init_args"]["model"] == MODELS[config.stem.rsplit("qwen", 1)[1]]
    assert raw["trainer"]["strategy"]["class_path"] == "lit_marl.parallel.strategies.TeamFSDPStrategy"
    per_layer = (raw["trainer"]["strategy"].get("init_args") or {}).get("mode") == "per_layer"
    assert per_layer == (not config.stem.endswith("1.5b"))  # 7B and up: gathered does not fit (the header)
    nodes = 2 if config.name in SERVED else 1
    assert (raw["trainer"]["precision"], raw["trainer"]["devices"], raw["trainer"]["num_nodes"]) == (
        "bf16-mixed",
        8,
        nodes,
    )
    assert raw["data"]["init_args"]["engine"] == ("vllm_server" if config.name in SERVED else "vllm")
    header = config.read_text().split("seed_everything")[0]
    assert "PLAN_" not in header and re.search(r"Memory per GPU.*GiB", header)
    cli = build_cli(args=_stand_in(config), run=False)
    module = cli.model
    assert module.memory.activation_checkpointing and module.memory.weights_dtype == "bfloat16"
    module.configure_model()
    assert module.references is not None and {p.dtype for p in module.references.parameters()} >= {torch.bfloat16}


def test_two_nodes_overlay_builds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert yaml.safe_load((ROOT / "configs" / "scale" / "two_nodes.yaml").read_text()) == {"trainer": {"num_nodes": 2}}
    cli = build_cli(args=_stand_in(CONFIGS[-1], "two_nodes.yaml"), run=False)
    assert cli.model.memory.weights_dtype == "bfloat16"


@pytest.mark.slow  # ~30 s a config: the plan measures the architecture's layers on CPU copies
@pytest.mark.parametrize(
    "name",
    [
        "textworld_grpo_qwen1.5b",
        "textworld_ppo_qwen1.5b",
        "textworld_grpo_qwen7b",
        "textworld_grpo_qwen14b",
        "textworld_grpo_qwen32b",
    ],
)
def test_header_carries_the_plan_it_claims(tmp_path, name):
    """The header's figure for one node equals scripts/plan_memory.py's peak (to 0.01 GiB) in the mode
    the config runs: per_layer where it says so, else what ``auto`` picks on 80 GB (gathered fits)."""
    config = ROOT / "configs" / "scale" / f"{name}.yaml"
    claimed = float(re.search(r"Memory per GPU[^:]*: ([\d.]+) GiB", config.read_text()).group(1))
    mode = "per_layer" if "mode: per_layer" in config.read_text() else "gathered"
    model = MODELS[name.rsplit("qwen", 1)[1]]
    ranks = "16" if f"{name}.yaml" in SERVED else "8"  # its trainer's 2 nodes
    command = [sys.executable, str(ROOT / "scripts" / "plan_memory.py"), str(config), "--ranks", ranks]
    command += ["--model", model, "--mode", mode]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, check=True)
    planned = float(re.search(r"peak\s+([\d.]+) GiB", done.stdout).group(1))
    assert abs(planned - claimed) <= 0.01, (planned, claimed)
    if f"{name}.yaml" in SERVED:  # the server's GPUs hold its vLLM: none of it on the trainer's
        assert "vLLM engines" not in done.stdout and "generation on the vLLM servers' own GPUs" in done.stdout
    if mode == "gathered":  # auto's choice: the gathered plan fits the card
        assert planned < 80
