"""``lit-marl fit`` with vLLM rollouts (``make test-vllm``), each in a fresh process: a team of two
distinct models (MAGRPO: two instances in one process), 2 ranks under DDP and FSDP2 (each rank its
own instances, vLLM's external launcher), and PPO on episodes with truncated importance sampling. In
every fit the second step samples from the weights the first step's update produced: its rollout
log-probs equal the trainer's (fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def _fit(tmp_path, config: str, *extra: str) -> dict[str, list[float]]:
    """``lit-marl fit`` in a fresh process with vLLM rollouts; its TensorBoard scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lit_marl = Path(sys.executable).parent / "lit-marl"
    args = [str(lit_marl), "fit", "--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path)]
    args += ["--data.init_args.engine", "vllm", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    scalars = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    scalars["log"] = done.stdout + done.stderr
    return scalars


def test_a_team_of_two_models_fits_with_vllm_rollouts(tmp_path):
    scalars = _fit(tmp_path, "configs/magrpo/slogan_tiny.yaml", "--trainer.limit_train_batches", "2")
    diffs = scalars["train/rollout_logp_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-3  # step 2 sampled from the updated weights
    assert all(torch.isfinite(torch.tensor(scalars["train/loss"])))


def test_a_lora_team_on_one_base_fits_with_one_vllm_instance(tmp_path):
    """Two agents as LoRA adapters on one base (``lora_shared_base``): one instance serves both, each
    agent's requests with its adapter, re-sent after each update; step 2 samples the updated team."""
    extra = ["--trainer.limit_train_batches", "2", "--model.init_args.lora", "{r: 8, alpha: 16}"]
    extra += ["--model.init_args.lora_shared_base", "true"]
    scalars = _fit(tmp_path, "configs/magrpo/slogan_tiny.yaml", *extra)
    assert scalars["log"].count("Initializing a V1 LLM engine") == 1  # one instance for the team
    diffs = scalars["train/rollout_logp_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_per_layer"])
def test_two_ranks_each_run_their_own_vllm(tmp_path, strategy):
    """Under DDP and FSDP2 (2 gloo ranks) every rank starts its own instances with vLLM's external
    launcher (the trainer's ranks are the launcher) and samples from the weights it synced (FSDP:
    gathered from the shards, one tensor at a time; per layer, the policies are not gathered for the
    rollout: each sharded weight is gathered as it streams into vLLM)."""
    extra = ["--trainer.callbacks=[]", "--trainer.enable_checkpointing", "false"]
    if strategy == "fsdp_per_layer":
        extra += ["--trainer.strategy.init_args.mode", "per_layer"]
    config = f"configs/magrpo/slogan_tiny_{strategy.removesuffix('_per_layer')}.yaml"
    scalars = _fit(tmp_path, config, *extra)
    assert scalars["log"].count("Using external launcher for distributed inference") == 4  # 2 ranks x 2 models
    diffs = scalars["train/rollout_logp_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-3


def test_ppo_on_episodes_fits_with_vllm_rollouts_and_truncated_is(tmp_path):
    scalars = _fit(tmp_path, "configs/ppo/corridor_tiny.yaml", "--model.init_args.update.rollout_is_cap", "2.0")
    diffs = scalars["train/rollout_logp_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-3
    assert "train/rollout_is_capped_frac" in scalars
    assert all(torch.isfinite(torch.tensor(scalars["train/loss"])))
