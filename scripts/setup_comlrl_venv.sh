#!/usr/bin/env bash
# Create /work/main/.venv-comlrl: a separate Python 3.11 environment with CoMLRL 1.4.3 (the reference
# multi-agent LLM RL trainers) for the side-by-side benchmark (scripts/bench_comlrl_worker.py).
# torch is installed FIRST and pinned to the CPU build (torch==2.13.0, the +cpu wheel on this machine):
# comlrl does not depend on torch itself, and a bare torch requirement would pull a multi-GB CUDA build.
# Idempotent: a stamp file records the finished install.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-comlrl"
STAMP="$VENV/.comlrl-1.4.3-torch-2.13.0.stamp"
PY="${PYTHON:-python3.11}"

if [[ -f "$STAMP" ]]; then
    echo "CoMLRL venv ready: $VENV"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install --upgrade pip
# CPU torch first (the pin resolves to the local +cpu wheel); then comlrl and its declared deps.
"$VPY" -m pip install "torch==2.13.0"
"$VPY" -m pip install "comlrl==1.4.3"
# Check that the pieces import (and that torch stayed the CPU build).
OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled "$VPY" - <<'PY'
import torch, transformers, comlrl
from comlrl.trainers.reinforce import MAGRPOTrainer, MAGRPOConfig
from comlrl.trainers.actor_critic import IACTrainer, IACConfig, MAACTrainer, MAACConfig
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("torch", torch.__version__, "transformers", transformers.__version__, "comlrl ok")
PY
date -u +%FT%TZ > "$STAMP"
echo "CoMLRL venv ready: $VENV"
