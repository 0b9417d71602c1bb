"""scripts/gpu_check_scale.py, the prepared GPU check of the memory plan, as a CPU smoke test: a tiny
Qwen2 in one gloo process runs every check but vLLM's (skipped: it needs a GPU) and writes one JSON
record per check; the device-memory figures are null on CPU, the flow is what is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "gpu_check_scale.py"
CHECKS = ["context", "per_layer_pass", "streamed_sync", "padding_passes", "setup", "vllm_cycle"]


def test_the_scale_check_runs_every_check_on_cpu(tmp_path):
    command = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--arch",
        "tiny",
        "--tokens",
        "64",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "gpu_check_scale.jsonl").read_text().splitlines()]
    assert [r["check"] for r in records] == CHECKS
    assert all(r["status"] in ("ok", "skipped") for r in records), [r for r in records if r["status"] != "ok"]
    by = {r["check"]: r for r in records}
    assert by["vllm_cycle"]["status"] == "skipped"
    padding = by["padding_passes"]
    assert padding["status"] == "ok" and padding["nonzero_gradients"] == 0 and padding["lockstep_own_passes"] == 0
    passes = by["per_layer_pass"]
    assert passes["plain"]["finite_gradients"] and passes["checkpointed"]["finite_gradients"]
    assert passes["checkpointed"]["planned_activations_gib"] <= passes["plain"]["planned_activations_gib"]
    assert by["setup"]["meta"]["loaded_exactly"] and by["setup"]["host"]["loaded_exactly"]
    assert by["streamed_sync"]["tensors"] > 0
    last = json.loads(done.stdout.strip().splitlines()[-1])  # the final line: every record again
    assert last["records"] == records
    lines = [line.split()[0] for line in done.stdout.splitlines() if line.split() and line.split()[0] in CHECKS]
    assert lines == CHECKS  # one human line per check
