"""The colocated vLLM engine's hand-over with the trainer on one GPU, with a fake backend (vLLM itself:
tests/vllm): the trainer's cache emptied before each wake, the checks before step 1 (sleep mode's
allocator: one instance per process, no expandable segments before vLLM 0.20.1), the profiler's token
budget, and the local rank that names vLLM's device."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_marl import ConfigError
from lit_marl.agents import AdapterView, Agent, LoraSettings, lora_config
from lit_marl.generation import make_engine, vllm_checks
from lit_marl.generation import vllm as vllm_module
from lit_marl.generation.vllm import LLMBackend, VLLMEngine, free_cached_memory, local_rank

ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
LOCAL_INDEXES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


class RecordingBackend:
    """Records the engine's calls, in order, in a list it shares with the test."""

    def __init__(self, events: list[str], sleeps: bool = True):
        self.events, self.sleeps = events, sleeps

    def load_weights(self, weights):
        for _ in weights:  # the engine streams them: every tensor is produced
            pass
        self.events.append("load")

    def add_adapter(self, name, folder):
        self.events.append(f"add_adapter:{name}")
        return name

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self, tags):
        self.events += [f"wake_up:{t}" for t in tags]


def recording_engine(events: list[str], **engine_options) -> VLLMEngine:
    """A vLLM engine whose backends record into ``events``, with the user's ``data.engine_options``
    (the options a real instance would start with; the fake backend ignores them)."""
    engine = VLLMEngine(backend_factory=lambda agent, dtype: RecordingBackend(events))
    engine.llm_kwargs = engine_options  # what VLLMEngine(**engine_options) keeps for the default backend
    return engine


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for name in ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def old_vllm(monkeypatch):
    """The installed vLLM is one whose sleep-mode allocator still refuses expandable segments."""
    monkeypatch.setattr(vllm_checks, "vllm_version", lambda: "0.19.1")


def lora_team(tokenizer) -> list[Agent]:
    """Two agents as LoRA adapters on one tiny Llama (``model.lora_shared_base``)."""
    from peft import get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    shared = get_peft_model(LlamaForCausalLM(config), lora_config(LoraSettings(r=4, alpha=8)), adapter_name="agent0")
    shared.add_adapter("agent1", lora_config(LoraSettings(r=4, alpha=8)))
    return [Agent("llama-tiny", loaded=(AdapterView(shared, f"agent{i}"), tokenizer)) for i in (0, 1)]


# --------------------------------------------------------------------------- the cache before each wake
def test_the_trainers_cache_is_emptied_before_each_wake(tiny_agent, monkeypatch):
    """A sleeping instance wakes its weights, takes the synced ones, then wakes its KV cache: the
    trainer's cached blocks go back to the device before each of the two wakes (after the update,
    and after the sync's gathered tensors), never while it is awake."""
    events: list[str] = []
    monkeypatch.setattr(vllm_module, "free_cached_memory", lambda device_type: events.append(f"free:{device_type}"))
    engine = recording_engine(events)
    for _ in range(2):
        with engine.rollout([tiny_agent]):
            pass
    device = next(tiny_agent.model.parameters()).device.type
    assert events == [
        "load",
        "sleep",
        f"free:{device}",
        "wake_up:weights",
        "load",
        f"free:{device}",
        "wake_up:kv_cache",
        "sleep",
    ]


def test_free_cached_memory_collects_and_empties_the_cuda_cache_only_on_cuda(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(vllm_module.gc, "collect", lambda *args: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    free_cached_memory("cpu")
    assert calls == []
    free_cached_memory("cuda")
    assert calls == ["gc.collect", "empty_cache"]  # garbage first: its blocks are then free to give back


# --------------------------------------------------------------------------- checks before step 1
@pytest.mark.parametrize("variable", ALLOC_CONF)
def test_expandable_segments_are_refused_with_sleep_mode_by_a_vllm_that_refuses_them(
    tiny_agent, monkeypatch, no_alloc_conf, old_vllm, variable
):
    monkeypatch.setenv(variable, "max_split_size_mb:128, expandable_segments : True")
    with pytest.raises(ConfigError) as error:
        recording_engine([]).check_team([tiny_agent], "cuda")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{variable}=")
    for fix in (f"unset {variable}", "expandable_segments:False", "{enable_sleep_mode: false}", "vLLM 0.19.1"):
        assert fix in message
    recording_engine([], enable_sleep_mode=True).check_team([tiny_agent], "cpu")  # vLLM's CPU build: no sleep mode
    recording_engine([], enable_sleep_mode=False).check_team([tiny_agent], "cuda")


@pytest.mark.parametrize(
    "conf", ["expandable_segments:False", "expandable_segments:True,expandable_segments:False", "max_split_size_mb:64"]
)
def test_allocator_settings_without_expandable_segments_are_accepted(
    tiny_agent, monkeypatch, no_alloc_conf, old_vllm, conf
):
    for variable in ALLOC_CONF:
        monkeypatch.setenv(variable, conf)
    recording_engine([]).check_team([tiny_agent], "cuda")


@pytest.mark.parametrize("version", ["0.20.1", "0.21.0rc1", "1.0.0", None])
def test_a_vllm_that_switches_expandable_segments_off_itself_is_not_refused(
    tiny_agent, monkeypatch, no_alloc_conf, version
):
    """vLLM 0.20.1 (vllm-project/vllm#40812) turns them off around its pool; an unknown vLLM says so itself."""
    monkeypatch.setattr(vllm_checks, "vllm_version", lambda: version)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    recording_engine([]).check_team([tiny_agent], "cuda")
    assert vllm_checks.refuses_expandable_segments("0.10.2") and vllm_checks.refuses_expandable_segments("0.20.0")


def test_two_models_with_sleep_mode_are_refused_on_gpu_only(tiny_agents, no_alloc_conf):
    """One sleep-mode instance per process: two models (two instances) are refused before step 1,
    naming every way out; on CPU, or with sleep mode off, they are accepted."""
    with pytest.raises(ConfigError) as error:
        recording_engine([]).check_team(tiny_agents, "cuda")
    message = str(error.value)
    assert "\n" not in message and "2 separate models" in message
    for fix in (
        "model.lora_shared_base: true",
        "model.lora",
        "model.share_parameters: true",
        "data.engine_options: {enable_sleep_mode: false}",
        "gpu_memory_utilization",
        "data.engine: torch",
    ):
        assert fix in message
    recording_engine([]).check_team(tiny_agents, "cpu")
    recording_engine([], enable_sleep_mode=True).check_team(tiny_agents, "cpu")  # several instances work there
    recording_engine([], enable_sleep_mode=False).check_team(tiny_agents, "cuda")


def test_one_served_model_is_accepted_as_the_engine_counts_instances(tiny_agent, no_alloc_conf):
    """A LoRA team on one shared base is one instance (each agent its adapter), as the rollout then
    starts it; a team sharing one model (``model.share_parameters``) too."""
    team = lora_team(tiny_agent.tokenizer)
    events: list[str] = []
    engine = recording_engine(events)
    engine.check_team(team, "cuda")
    with engine.rollout(team):
        pass
    assert len(engine.backends) == 1 and events.count("load") == 1
    shared = [tiny_agent, Agent(tiny_agent.source, loaded=(tiny_agent.model, tiny_agent.tokenizer))]
    recording_engine([]).check_team(shared, "cuda")


def test_engines_that_serve_the_trainers_weights_check_nothing(tiny_agents, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for name in ("torch", "hf"):
        assert make_engine(name).check_team(tiny_agents, "cuda") is None


# --------------------------------------------------------------------------- the profiler's token budget
def test_gpu_instances_get_a_token_budget_that_the_user_overrides():
    engine = recording_engine([])
    assert engine.options("cuda")["max_num_batched_tokens"] == 4096
    engine.llm_kwargs = {"max_num_batched_tokens": 8192}
    assert engine.options("cuda")["max_num_batched_tokens"] == 8192
    assert engine.options("cuda")["enable_sleep_mode"] is True  # the other defaults stay


# --------------------------------------------------------------------------- vLLM's device
@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher variable; each one restored (or removed) after the test, whoever sets it."""
    for name in (*LOCAL_INDEXES, "RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "0")  # recorded for the undo, then removed
        monkeypatch.delenv(name)


def test_local_rank_comes_from_the_launchers_local_index(monkeypatch, no_launcher):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_rank() == 0  # one process
    monkeypatch.setenv("MPI_LOCALRANKID", "2")
    assert local_rank() == 2
    monkeypatch.setenv("SLURM_LOCALID", "3")  # srun: the global rank on a second node is not it
    assert local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun, Lightning
    assert local_rank() == 1


def test_local_rank_falls_back_to_the_global_rank_only_within_one_node(monkeypatch, no_launcher):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    assert local_rank() == 3
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 8)
    with pytest.raises(RuntimeError, match="set LOCAL_RANK"):
        local_rank()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the trainer's GPU is chosen
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert local_rank() == 2


def test_an_instance_under_srun_gets_its_local_index_as_local_rank(tiny_agent, monkeypatch, no_launcher):
    """Rank 5 of 8 (the second node), started by srun (no LOCAL_RANK): vLLM's LOCAL_RANK is 1."""
    started = {}
    fake_vllm = types.ModuleType("vllm")
    fake_vllm.LLM = lambda **kwargs: started.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):  # LLMBackend's defaults
        monkeypatch.setenv(name, os.environ.get(name, "0"))  # as they were after the test
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 5)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 8)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    LLMBackend(tiny_agent, "float32", external_launcher=True)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("5", "1", "8")
    assert started["distributed_executor_backend"] == "external_launcher"


def test_the_module_asks_the_engine_before_the_first_step(tmp_path):
    """``check_team`` runs once the team is built and before any rollout: its refusal stops the fit at step 0."""
    from helpers import make_trainer, slogan_data
    from lit_marl.algorithms import MAGRPO

    seen = []

    def refuse(agents, device_type):
        seen.append((len(agents), device_type))
        raise ConfigError("refused before step 1")

    data = slogan_data()
    data.engine.check_team = refuse
    module = MAGRPO(model="tiny-random", num_agents=2)
    with pytest.raises(ConfigError, match="refused before step 1"):
        make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(module, datamodule=data)
    assert seen == [(2, "cpu")] and module.global_step == 0
