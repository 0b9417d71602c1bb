"""A `lit-marl fit` process started with nothing set computes with what this CPU does fast (the
precision its units compute, one thread per usable CPU that sleeps when idle); a user's environment
and explicit precision win, with one line when that precision is emulated here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from lit_marl import cpu

ROOT = Path(__file__).resolve().parents[2]
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", cpu.OURS, cpu.PRECISION_ENV)


def fit(tmp_path: Path, extra_env: dict, *args: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED and k not in cpu.ONEDNN_ISA}
    env.update(extra_env, CPU_CHOICES_OUT=str(tmp_path / "choices.json"), PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run(
        [sys.executable, "-m", "lit_marl.cli", "fit", "--config", "configs/grpo/corridor_tiny.yaml",
         "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
         "--trainer.default_root_dir", str(tmp_path),
         "--trainer.callbacks+=cpu_choices.RecordChoices", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "choices.json").read_text()), done.stderr


def test_nothing_set_gets_the_cpus_precision_and_sleeping_threads(tmp_path):
    choices, stderr = fit(tmp_path, {})
    expected = cpu.auto_precision("cpu", environ={})  # this CPU's flags: bf16-mixed with bf16 units, else 32-true
    assert choices["precision"] == expected
    assert choices["autocast"] == (expected == "bf16-mixed")  # Lightning autocasts the steps to it
    assert choices["threads"] == cpu.usable_cpus() and choices["OMP_NUM_THREADS"] == str(cpu.usable_cpus())
    assert choices["interop_threads"] == 1
    assert choices["OMP_WAIT_POLICY"] == "PASSIVE"
    line = next(line for line in stderr.splitlines() if line.startswith("lit-marl: CPU run:"))
    assert f"precision {expected}" in line and "OMP_WAIT_POLICY=PASSIVE" in line
    assert "emulated" not in stderr
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["precision"] is None  # the saved config leaves it to the CPU it is run on next


def test_a_cpu_without_bf16_units_gets_fp32(tmp_path):
    """oneDNN held below the bf16 ISAs emulates bf16 as a CPU without bf16 units does."""
    choices, _ = fit(tmp_path, {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert choices["precision"] == "32-true" and not choices["autocast"]


def test_the_users_environment_and_precision_win_with_a_notice_when_emulated(tmp_path):
    """An explicit precision wins over the automatic one and over LIT_MARL_PRECISION (which only
    replaces the automatic choice), with one line when this CPU emulates it."""
    choices, stderr = fit(
        tmp_path,
        {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
        | {cpu.PRECISION_ENV: "32-true"},
        "--trainer.precision", "bf16-mixed",
    )  # fmt: skip
    assert choices == {
        "precision": "bf16-mixed",
        "threads": 1,
        "interop_threads": 1,
        "OMP_WAIT_POLICY": "ACTIVE",
        "OMP_NUM_THREADS": "1",
        "autocast": True,
    }
    notices = [line for line in stderr.splitlines() if "emulated" in line]
    assert len(notices) == 1 and "trainer.precision=bf16-mixed" in notices[0] and "unset" in notices[0]
