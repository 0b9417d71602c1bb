"""The vLLM generation engine (optional: ``make vllm`` builds ``.venv-vllm`` with vLLM's CPU build;
on GPU machines install a vLLM build for the torch release this project pins).

Colocated, as TRL's ``vllm_mode=colocate`` and verl's hybrid engine: every rank runs its own vLLM
instance beside its trainer, one instance per distinct model of the team; the agents of a team of
LoRA adapters on one base (``AdapterView``, ``model.lora_shared_base``) share the base's instance,
which loads the base once and each agent's adapter as a LoRA request (saved anew when it changed).
An instance starts from the model's config alone (a temporary folder, ``load_format="dummy"``, no
tokenizer: prompts go in as token ids), so nothing is read from disk or the hub: the trainer's
weights are what it serves. vLLM keeps its own copy of them, so every rollout (``rollout``) first
compares each served model's parameter versions (every in-place optimizer step bumps them, and every
FSDP gather) with those it last loaded and, when they changed, streams ``effective_weights`` into
vLLM (one tensor at a time in the serving dtype, each tied weight once, LoRA merged, sharded weights
gathered as they go) and empties vLLM's prefix cache, whose keys and values were computed with the
old weights. On a GPU an instance sleeps between rollouts (``enable_sleep_mode``), the trainer's cached
memory emptied before each wake; ``check_team`` refuses before step 1 what sleep mode cannot start
(``vllm_checks.py``: one sleeping instance per process).

Each sample comes back with the log-prob vLLM computed for every token it sampled (the raw model
distribution, before temperature, top-k and top-p: what the trainer's forward recomputes), so the trainer
can measure and correct the mismatch (``losses.truncated_is_weights``).

``VLLMEngine`` owns the bookkeeping, tested with a fake backend (``tests/unit/test_engines.py``):
rows ↔ prompts × samples (row ``i * n + k`` = sample k of prompt i), the end token kept on stopped
samples, right padding after it and the completion mask, left-padded prompts, the weight versions.
``LLMBackend`` is the real ``vllm.LLM`` (``tests/vllm/``, ``make test-vllm``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from lit_marl.agents import REFERENCE_SUFFIX, AdapterView, Agent
from lit_marl.generation.base import Generation, Sampling, generate_each, left_pad, mask_through_first
from lit_marl.generation.decoder import _causal_lm
from lit_marl.generation.vllm_checks import check_sleep_mode
from lit_marl.generation.weights import effective_weights, weight_version


def sampling_params(sampling: Sampling, n: int, stop_token_ids: list[int]) -> dict:
    """vLLM's ``SamplingParams`` arguments for one call: ``n`` samples per prompt under ``sampling``
    (greedy: temperature 0, vLLM's), token ids out, each sampled token's own log-prob."""
    greedy = sampling.greedy
    return {
        "n": n,
        "max_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0 if greedy else sampling.top_k or 0,  # 0: off (vLLM: all tokens)
        "stop_token_ids": stop_token_ids,
        "detokenize": False,
        "logprobs": 0,
    }


@dataclass
class Sample:
    token_ids: list[int]
    finish_reason: str  # "stop" (an end/stop token) or "length"
    logprobs: list[float] | None = field(default=None)  # per token of token_ids (raw model log-probs)


class VLLMBackend(Protocol):
    def generate(self, prompts: list[list[int]], params: dict, adapter=None) -> list[list[Sample]]:
        """For each prompt, in order, its ``params["n"]`` samples (``params``: ``sampling_params``'s; with
        ``adapter``: a handle from ``add_adapter``, the LoRA adapter applied to the served base)."""

    def add_adapter(self, name: str, folder: str):
        """Register the LoRA adapter saved in ``folder`` (peft's format) under a new name; its handle."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights (transformers' names, full tensors), and forget every cached
        prefix computed with the old ones."""

    sleeps: bool  # frees its weights and KV cache between rollouts (vLLM's sleep mode)

    def sleep(self) -> None:
        """Free the weights and the KV cache (level 2: the weights are synced in again on waking)."""

    def wake_up(self, tags: list[str]) -> None:
        """Allocate ``weights`` or ``kv_cache`` again."""


# vLLM's memory settings where the user gives none. A GPU instance takes a share of the card; on
# CPU, vLLM's share would be of the machine's memory minus this whole process (the trainer
# included), so the KV cache gets a fixed budget; and CPU graph compilation takes minutes at every
# start (its cache is not reused), so CPU instances run eagerly.
# A GPU instance sleeps while the trainer updates (TRL's and verl's colocated rhythm).
# max_num_batched_tokens, the tokens of one engine step, is also the size of the dummy step vLLM's
# memory profiler runs at start beside the trainer's memory; its default for the LLM class (8192, 16384
# on the largest cards) sizes that peak for serving, not for a rollout's batch (TRL pins 4096 too). It
# does not cap prompts: vLLM V1 prefills longer ones in chunks (chunked prefill, on by default); only
# with enable_chunked_prefill: false does vLLM refuse a budget under max_model_len (raise it then).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values
GPU_DEFAULTS = dict(gpu_memory_utilization=0.3, enable_sleep_mode=True, max_num_batched_tokens=4096)
CPU_DEFAULTS = dict(kv_cache_memory_bytes=1 << 30, enforce_eager=True)


def lora_slots(adapters: dict) -> dict:
    """vLLM's settings that serve ``adapters`` (their LoRA configs by name) beside one base: LoRA on, a
    slot per adapter, the smallest of vLLM's slot ranks that holds the largest."""
    rank = max(config.r for config in adapters.values())
    allowed = [r for r in LORA_RANKS if r >= rank]  # vLLM's slots come in these sizes
    if not allowed:
        raise ValueError(f"model.lora.r={rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_lora_rank=allowed[0], max_loras=len(adapters))


class LLMBackend:
    """A real ``vllm.LLM`` for one model, in this process (V1 multiprocessing off so that the weights
    stream in without leaving it). ``external_launcher``: the trainer's ranks are the launcher
    (under torch.distributed, one instance per rank); else vLLM sets up its own one-process group."""

    def __init__(self, agent: Agent, dtype: str, external_launcher: bool, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's CPU backend can pin OpenMP threads to fixed cores (its default, ``auto``): the ranks'
        # engines would pin to the same cores, and a pinned thread on a core another process keeps busy
        # cannot move. The trainer's threads stay as lit_marl set them (cpu.py); the user's value wins
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.folder = tempfile.TemporaryDirectory(prefix="lit_marl_vllm_")
        _causal_lm(agent.model).config.save_pretrained(self.folder.name)  # the architecture only
        kwargs = dict(
            enable_prefix_caching=True,
            dtype=dtype,
            load_format="dummy",  # the trainer's weights are synced in before the first generation
            skip_tokenizer_init=True,  # token ids in and out
            generation_config="vllm",  # no sampling defaults from the model's folder: ours only
            seed=0,
        )
        if external_launcher:
            rank = torch.distributed.get_rank()  # the launcher's variables, where it did not set them
            for name, value in (
                ("RANK", rank),
                ("LOCAL_RANK", local_rank()),  # vLLM's device: cuda:{LOCAL_RANK}
                ("WORLD_SIZE", torch.distributed.get_world_size()),
            ):
                os.environ.setdefault(name, str(value))
            kwargs.update(distributed_executor_backend="external_launcher", seed=rank)
        adapters = served_adapters(agent)
        if adapters:  # a team of LoRA agents on one base: one instance, each agent's adapter per request
            kwargs.update(lora_slots(adapters))
        kwargs.update(llm_kwargs)
        self.sleeps = bool(kwargs.get("enable_sleep_mode", False))
        self.adapters = 0
        with kept_random_state():  # in this process vLLM seeds the global generators: the run's own stay
            self.llm = LLM(model=self.folder.name, **kwargs)

    def add_adapter(self, name, folder):
        from vllm.lora.request import LoRARequest

        self.adapters += 1  # a new id for every version: vLLM caches adapters (and prefixes) by id
        return LoRARequest(name, self.adapters, folder)

    def generate(self, prompts, params, adapter=None):
        from vllm import SamplingParams

        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, SamplingParams(**params), use_tqdm=False, lora_request=adapter)
        return [
            [
                Sample(list(o.token_ids), o.finish_reason, [d[t].logprob for t, d in zip(o.token_ids, o.logprobs)])
                for o in out.outputs
            ]
            for out in outputs
        ]

    def load_weights(self, weights):
        # vLLM's in-place reload: layer by layer, its CPU kernels' repacking redone; the worker's
        # model.load_weights would write into weights the CPU backend has already repacked and dropped
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def sleep(self):
        self.llm.sleep(level=2)

    def wake_up(self, tags):
        self.llm.wake_up(tags=tags)


def local_rank() -> int:
    """This process's index on its node (vLLM serves on ``cuda:{LOCAL_RANK}``): ``LOCAL_RANK`` (torchrun,
    Lightning's launcher), else ``SLURM_LOCALID`` (srun), else the GPU the trainer already uses (CUDA
    initialised), else Open MPI's or MPICH's local rank, else the global rank, which is the local one
    only while the world fits one node's GPUs (an error otherwise: the global rank would name a GPU
    that is not there)."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices and world > devices:
        raise RuntimeError(
            f"data.engine=vllm: rank {rank} of {world} has no local index from its launcher (LOCAL_RANK, "
            f"SLURM_LOCALID) and the world spans more than this node's {devices} GPUs; set LOCAL_RANK"
        )
    return rank


def free_cached_memory(device_type: str) -> None:
    """Return the trainer's cached, unused blocks to the device before an instance maps its weights or
    KV cache in again (TRL empties the cache before every wake_up too): vLLM's sleep-mode pool allocates
    beside torch's cache, so what the cache keeps after the update (and the weights' streaming) is
    memory the wake cannot have. Nothing to do on CPU."""
    if device_type == "cuda":
        gc.collect()  # tensors only the garbage collector frees give their blocks back first
        torch.cuda.empty_cache()


@contextlib.contextmanager
def kept_random_state():
    """Python's, numpy's and torch's (CPU and CUDA) global random states as they were before the block."""
    import numpy as np

    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def compute_dtype(device_type: str) -> str:
    """The dtype the trainer's passes compute in right now, for vLLM's ``dtype``: bf16 inside
    ``trainer.precision: bf16-mixed``'s autocast (rollouts run in it), else float32. vLLM's own
    default (``auto``: the checkpoint's, bf16 for Qwen) would sample an fp32 team from another
    policy than the one the update scores."""
    if torch.is_autocast_enabled(device_type):
        return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return "float32"


def check_serving_dtype(engine: str, agent: Agent, serves: str) -> None:
    """Raise where this rollout computes in another dtype than the copy ``agent``'s model is served in
    (an engine's copy keeps the dtype it started with)."""
    now = compute_dtype(next(agent.model.parameters()).device.type)
    if now != serves:
        raise RuntimeError(
            f"the {engine} engine of {agent.source} serves {serves}, but this rollout computes in {now}: one "
            "engine cannot change dtype; roll out in one precision"
        )


def served(agent: Agent) -> tuple[torch.nn.Module, str | None]:
    """The model an instance serves for ``agent`` and the LoRA adapter its requests apply: the agents of
    a team's adapters on one base (``AdapterView``) share the base's instance, each its own adapter."""
    model = agent.model
    return (model.shared, model.adapter) if isinstance(model, AdapterView) else (model, None)


def adapters_off(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LoRA layers are switched off (``disable_adapter``: the initial policy)."""
    return any(m.disable_adapters for m in model.modules() if hasattr(m, "lora_A"))


def request_adapter(agent: Agent) -> str | None:
    """The adapter a generation by ``agent`` applies on its base's instance: its own, or None (the base
    alone) while the adapters are switched off (a LoRA team's initial policy: MADPO's candidates)."""
    model, adapter = served(agent)
    return None if adapter is None or adapters_off(model) else adapter


def each_served(agents: list[Agent], per_adapter: bool = True) -> list[Agent]:
    """The first agent of each distinct served model (with ``per_adapter``: of each model and adapter), in
    the team's order: what an engine keeps a copy of, and the syncs a rollout makes."""
    first: dict[tuple, Agent] = {}
    for agent in agents:
        model, adapter = served(agent)
        first.setdefault((id(model), adapter if per_adapter else None), agent)
    return list(first.values())


def base_version(agent: Agent) -> tuple:
    """The version of the weights an engine's copy of ``agent``'s served model holds (a LoRA team's: the
    base's alone, its adapters apart)."""
    model, adapter = served(agent)
    return weight_version(model, (lambda n: "lora_" not in n) if adapter else None)


def adapter_version(agent: Agent, adapter: str) -> tuple:
    """The version of ``adapter``'s weights on ``agent``'s LoRA team base."""
    return weight_version(agent.model.shared, lambda n: f".{adapter}." in n)


@contextlib.contextmanager
def base_alone(model: torch.nn.Module):
    """``model`` with its adapters off for the block (peft's ``disable_adapter`` switches them on again at its
    end: entered only where they are on, so an outer block that switched them off keeps them off)."""
    if adapters_off(model):
        yield
        return
    with model.disable_adapter():
        yield


def served_adapters(agent: Agent) -> dict:
    """The LoRA configs an instance serving ``agent``'s base applies (none: it serves merged weights); a
    KL reference adapter kept beside a policy's is never sampled from."""
    model, adapter = served(agent)
    if adapter is None:
        return {}
    return {name: c for name, c in model.peft_config.items() if not name.endswith(REFERENCE_SUFFIX)}


class VLLMEngine:
    name = "vllm"
    own_weights = True
    remote = False

    def __init__(self, backend_factory: Callable[[Agent, str], VLLMBackend] | None = None, **llm_kwargs):
        """``backend_factory(agent, dtype)`` makes the backend for one model (default: a ``vllm.LLM``
        with ``llm_kwargs``, e.g. ``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``)."""
        if backend_factory is None:
            if importlib.util.find_spec("vllm") is None:
                raise ImportError(
                    f"data.engine=vllm: vllm is not installed; `make vllm` builds .venv-vllm with vLLM's CPU "
                    f"build, on a GPU machine install a vLLM build for torch {torch.__version__}; or use engine: auto"
                )
            backend_factory = self._llm
        elif llm_kwargs:
            raise ValueError(f"VLLMEngine: {sorted(llm_kwargs)} go to the default backend, not a backend_factory")
        self.backend_factory = backend_factory
        self.llm_kwargs = llm_kwargs  # the memory plan counts the share or KV budget (``options``)
        self.backends: dict[int, VLLMBackend] = {}
        self.dtypes: dict[int, str] = {}
        self.versions: dict[int, tuple] = {}
        self.syncs = 0  # weight loads so far (all models)
        self.asleep: set[int] = set()  # models whose backend sleeps: weights and KV freed
        self.adapters: dict[tuple[int, str], tuple] = {}  # (base, adapter) -> (version, handle, folder)
        self.adapter_syncs = 0
        self.folder: tempfile.TemporaryDirectory | None = None  # the adapters' saved versions
        self.external_launcher: bool | None = None  # decided before the first instance starts

    def options(self, device_type: str) -> dict:
        """The ``vllm.LLM`` memory and compilation settings on this device: the defaults, then the user's."""
        return {**(CPU_DEFAULTS if device_type == "cpu" else GPU_DEFAULTS), **self.llm_kwargs}

    def check_team(self, agents: list[Agent], device_type: str) -> None:
        """Before step 1, on GPU: the settings the instances will start with (``options``), against the
        team's served models (one instance each: a LoRA team on a shared base is one) and the
        environment; ``ConfigError`` for what vLLM would refuse at the first rollout. On CPU vLLM has no
        sleep mode, and several instances share a process."""
        if device_type != "cpu":
            models = {id(served(agent)[0]): agent.source for agent in agents}
            check_sleep_mode(self.options(device_type), list(models.values()))

    def _llm(self, agent: Agent, dtype: str) -> LLMBackend:
        if self.external_launcher is None:  # a first instance sets up a process group of its own
            self.external_launcher = torch.distributed.is_available() and torch.distributed.is_initialized()
        options = self.options(next(agent.model.parameters()).device.type)
        return LLMBackend(agent, dtype, self.external_launcher, **options)

    def sync(self, agent: Agent) -> tuple[VLLMBackend, object]:
        """The backend serving ``agent`` (holding its current weights in the trainer's compute dtype)
        and the handle of its LoRA adapter there (None: merged weights)."""
        model, adapter = served(agent)
        key = id(model)
        device = next(model.parameters()).device
        if key not in self.backends:
            self.dtypes[key] = compute_dtype(device.type)
            self.backends[key] = self.backend_factory(agent, self.dtypes[key])
        else:
            check_serving_dtype(self.name, agent, self.dtypes[key])
        backend = self.backends[key]
        if key in self.asleep:  # level-2 sleep dropped the weights: wake them, sync, then the KV cache
            free_cached_memory(device.type)
            backend.wake_up(["weights"])
            self.versions.pop(key, None)
            self.adapters = {k: v for k, v in self.adapters.items() if k[0] != key}
        version = base_version(agent)
        if self.versions.get(key) != version:
            dtype = getattr(torch, self.dtypes[key])
            with base_alone(model) if adapter else contextlib.nullcontext():
                backend.load_weights(effective_weights(model, dtype))
            self.versions[key] = version
            self.syncs += 1
        applied = request_adapter(agent)  # None: the base alone (no adapter, or the adapters off)
        handle = self._adapter(agent, key, applied) if applied else None
        if key in self.asleep:
            free_cached_memory(device.type)  # the gathered and merged tensors of the sync, cached
            backend.wake_up(["kv_cache"])
            self.asleep.discard(key)
        return backend, handle

    def _adapter(self, agent: Agent, key: int, adapter: str):
        """The handle of the current version of ``agent``'s adapter in its base's instance: saved
        (peft's format, a few MB) and registered anew when its weights changed."""
        version = adapter_version(agent, adapter)
        known = self.adapters.get((key, adapter))
        if known is not None and known[0] == version:
            return known[1]
        if self.folder is None:
            self.folder = tempfile.TemporaryDirectory(prefix="lit_marl_vllm_adapters_")
        self.adapter_syncs += 1
        folder = os.path.join(self.folder.name, f"{adapter}-{self.adapter_syncs}")
        agent.model.save_adapter(Path(folder))
        handle = self.backends[key].add_adapter(f"{adapter}-{self.adapter_syncs}", folder)
        if known is not None:  # the version before: loaded by its last generation, not needed again
            shutil.rmtree(known[2], ignore_errors=True)
        self.adapters[key, adapter] = (version, handle, folder)
        return handle

    @contextlib.contextmanager
    def rollout(self, agents):
        """Every distinct model of ``agents`` synced first, in order (every rank reaches the same
        syncs, whose sharded weights gather tensor by tensor), then the rollout; after it, instances
        with sleep mode free their weights and KV cache for the update."""
        for agent in each_served(agents):
            self.sync(agent)
        try:
            yield
        finally:
            for key, backend in self.backends.items():
                if backend.sleeps and key not in self.asleep:
                    backend.sleep()
                    self.asleep.add(key)

    def close(self) -> None:
        return None  # its instances live in this process, freed with the engine

    def generate_team(self, calls, sampling, seeds=None):
        if seeds is not None:
            raise ValueError(f"data.sampling_streams=per_task needs the lean decoder, not the {self.name} engine")
        return generate_each(self, calls, sampling)

    @torch.no_grad()
    def generate(self, agent, prompts, num_samples, sampling):
        backend, adapter = self.sync(agent)
        outputs = backend.generate(prompts, sampling_params(sampling, num_samples, [agent.eos_token_id]), adapter)
        return generation_of(agent, prompts, num_samples, outputs, sampling.max_new_tokens)


def generation_of(
    agent: Agent, prompts: list[list[int]], num_samples: int, outputs: list[list[Sample]], max_new_tokens: int
) -> Generation:
    """The ``Generation`` of vLLM's samples (per prompt, in order, its ``num_samples``): rows ``i * n + k``,
    the end token that stopped a sample kept (vLLM drops a stop token it was given), right padding
    after it, left-padded prompts; the log-probs where every sample has one per token."""
    if len(outputs) != len(prompts) or any(len(o) != num_samples for o in outputs):
        raise RuntimeError(
            f"vllm returned {[len(o) for o in outputs]} samples for {len(prompts)} prompts × {num_samples}"
        )
    eos = agent.eos_token_id
    rows, row_logprobs = [], []
    for samples in outputs:
        for sample in samples:
            ids = list(sample.token_ids)[:max_new_tokens]
            logprobs = list(sample.logprobs or [])[: len(ids)]
            if sample.finish_reason == "stop" and (not ids or ids[-1] != eos) and len(ids) < max_new_tokens:
                ids.append(eos)  # the end token that stopped the sample is part of the response
            rows.append(ids)
            row_logprobs.append(logprobs if sample.logprobs is not None and len(logprobs) == len(ids) else None)
    device = next(agent.model.parameters()).device
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(num_samples)], agent.pad_token_id, device)
    width = max(1, max(len(r) for r in rows))
    completion_ids = torch.full((len(rows), width), agent.pad_token_id, dtype=torch.long, device=device)
    completion_logprobs = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    for i, (ids, logprobs) in enumerate(zip(rows, row_logprobs)):
        completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
        if logprobs is not None:
            completion_logprobs[i, : len(ids)] = torch.tensor(logprobs, dtype=torch.float32, device=device)
    completion_mask = mask_through_first(completion_ids, eos)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    completion_mask &= (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
    complete = all(lp is not None for lp in row_logprobs)  # a dropped end token has no log-prob of its own
    return Generation(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        num_samples,
        completion_logprobs * completion_mask if complete else None,
    )
