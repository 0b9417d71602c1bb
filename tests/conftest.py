"""Shared test setup: offline, single-threaded, fp32 where a config leaves the precision to the CPU,
and a throwaway model cache.

The model cache (``LIT_MARL_CACHE``) points at a fresh temporary folder for the run (shared by its
pytest-xdist workers), so the tests also cover building the tiny random model from scratch and
never touch the user's cache.
Set ``LIT_MARL_TEST_CACHE=/some/folder`` to reuse a cache between runs instead. The slow SmolLM2
test switches to the real default cache itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# a config without trainer.precision gets its CPU's (bf16 where the CPU has bf16 units): the tests'
# numbers must not hang on the machine, so they compute in fp32 unless a test sets a precision
os.environ["LIT_MARL_PRECISION"] = "32-true"

if os.environ.get("LIT_MARL_TEST_CACHE"):
    os.environ["LIT_MARL_CACHE"] = os.environ["LIT_MARL_TEST_CACHE"]
else:
    # one cache for the pytest-xdist workers of a run (named by the controller's pid, their parent):
    # the tiny model and the generated TextWorld games are built once, not once per worker. Every
    # writer of the cache is safe against a concurrent one (a file lock or a write-then-rename).
    # The controller (or a run without workers) removes it at exit; workers exit before it.
    _worker = "PYTEST_XDIST_WORKER" in os.environ
    _session_cache = os.path.join(
        tempfile.gettempdir(), f"lit_marl_test_cache-{os.getppid() if _worker else os.getpid()}"
    )
    if not _worker:  # a killed run's leftover under a reused pid is not this run's cache
        shutil.rmtree(_session_cache, ignore_errors=True)
        atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)
    os.makedirs(_session_cache, exist_ok=True)
    os.environ["LIT_MARL_CACHE"] = _session_cache

# `datasets` caches every task file it reads: keep that out of the user's HF cache too
_datasets_cache = tempfile.mkdtemp(prefix="lit_marl_test_datasets-")
os.environ["HF_DATASETS_CACHE"] = _datasets_cache
atexit.register(shutil.rmtree, _datasets_cache, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from helpers import REPO_ROOT  # noqa: E402


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def in_repo_root(repo_root, monkeypatch) -> Path:
    """Run the test from the repository root, where the configs' relative data paths resolve.

    Also hides pytest's own command line from LightningCLI, which reads ``sys.argv``.
    """
    monkeypatch.chdir(repo_root)
    monkeypatch.setattr(sys, "argv", ["lit-marl"])
    return repo_root


@pytest.fixture(scope="session")
def tiny_agent():
    """One tiny-random agent shared by tests that do not change its weights or tokenizer."""
    from lit_marl.agents import Agent

    return Agent("tiny-random")


@pytest.fixture(scope="session")
def tiny_agents():
    """Two independent tiny-random agents (shared, read-only)."""
    from lit_marl.agents import Agent

    return [Agent("tiny-random"), Agent("tiny-random")]


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to build an agent or a critic (load weights) is recorded and refused."""
    from lit_marl.algorithms import base, critics

    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("a model was loaded although the configuration is invalid")

    monkeypatch.setattr(base, "Agent", refuse)
    monkeypatch.setattr(critics, "load_model_and_tokenizer", refuse)
    return calls


@pytest.fixture(scope="session")
def magrpo_checkpoint(tmp_path_factory):
    """One step of MAGRPO on the slogan task through ``lit-marl fit``, checkpointed by StepCheckpoint
    (with its checksum): ``<dir>/ckpt/last.ckpt``; the run's config.yaml is saved beside its logs,
    ``<dir>/magrpo_slogan_tiny/version_0/config.yaml``."""
    from helpers import checkpointed_config, cli_fit
    from lit_marl import checkpoint_files

    tmp_path = tmp_path_factory.mktemp("magrpo_checkpoint")
    argv, sys.argv, cwd = sys.argv, ["lit-marl"], os.getcwd()
    try:
        os.chdir(REPO_ROOT)
        cli_fit(tmp_path, config=checkpointed_config(tmp_path, "first.yaml"))
    finally:
        os.chdir(cwd)
        sys.argv = argv
    path = tmp_path / "ckpt" / "last.ckpt"
    assert path.is_file() and checkpoint_files.sidecar(path).is_file()
    return path
