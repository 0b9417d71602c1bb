"""``lit-marl fit`` with vLLM rollouts (``make test-vllm``), each in a fresh process: a team of two
distinct models (MAGRPO: two instances in one process), 2 ranks under DDP and FSDP2 (each rank its
own instances, vLLM's external launcher), and PPO on episodes with truncated importance sampling. In
every fit the second step samples from the weights the first step's update produced: its rollout
log-probs equal the trainer's (fp32)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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


SERVER_OPTIONS = "{server_args: {max_model_len: 1024, max_num_seqs: 16}, timeout_s: 120}"


def test_ppo_on_episodes_fits_with_a_vllm_server(tmp_path):
    """The run starts a vLLM server, sends the weights before each rollout (lit_marl_gloo) and stops it at
    the end: step 2 samples from the weights step 1's update produced."""
    extra = ["--data.init_args.engine", "vllm_server", "--data.init_args.engine_options", SERVER_OPTIONS]
    before = _servers()
    scalars = _fit(tmp_path, "configs/ppo/corridor_tiny.yaml", *extra)
    diffs = scalars["train/rollout_logp_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-3
    assert _servers() <= before  # the run's server stopped with it


def _servers() -> set[str]:
    """The pids of servers the vllm_server engine started (their model folders' prefix) that run now."""
    found = subprocess.run(["pgrep", "-f", "lit_marl_server_"], capture_output=True, text=True).stdout
    return set(found.split())


def test_a_server_killed_mid_run_stops_it_named_and_a_resume_continues(tmp_path):
    """The server killed after step 1's checkpoint: the run stops with an error naming the server (not a
    stall), the checkpoint of step 1 stays whole, and a resume from it starts a new server and trains on."""
    lit_marl = Path(sys.executable).parent / "lit-marl"
    folder = tmp_path / "checkpoints"
    callbacks = f"[{{class_path: lit_marl.callbacks.StepCheckpoint, init_args: {{dirpath: {folder}}}}}]"
    args = [str(lit_marl), "fit", "--config", "configs/ppo/corridor_tiny.yaml", "--trainer.limit_train_batches", "6"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.callbacks", callbacks]
    args += ["--trainer.enable_checkpointing", "true"]
    args += ["--data.init_args.engine", "vllm_server", "--data.init_args.engine_options", SERVER_OPTIONS]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not (folder / "last.ckpt").exists() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.5)
    assert (folder / "last.ckpt").exists(), "no checkpoint after step 1"
    subprocess.run(["pkill", "-9", "-f", "lit_marl_server_"], check=True)
    output, _ = run.communicate(timeout=300)
    assert run.returncode != 0
    assert re.search(r"vLLM server http://127\.0\.0\.1:\d+/\S+: .*", output) and "exited with code -9" in output
    batches = _batches_done(folder / "last.ckpt")
    assert batches >= 1
    resumed = args[:4] + ["--trainer.limit_train_batches", str(batches + 1)] + args[6:]
    resumed += ["--ckpt_path", str(folder / "last.ckpt")]
    done = subprocess.run(resumed, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert _batches_done(folder / "last.ckpt") == batches + 1  # it trained on from where it stopped


def _batches_done(checkpoint: Path) -> int:
    """Training steps (rollout batches) a checkpoint has completed."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"]
