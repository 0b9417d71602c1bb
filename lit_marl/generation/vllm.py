"""The vLLM generation engine (optional, GPU machines): install a vLLM build made for the torch
release this project pins (vLLM pins torch exactly, so it is not a declared extra).

Colocated, as TRL's ``vllm_mode=colocate``: every rank runs its own vLLM instance beside its
trainer, one instance per distinct model of the team (an ``AdapterView`` agent gets its own, with
its adapter merged). vLLM keeps its own copy of the weights, so before each generation the engine
compares the model's parameter versions (every in-place optimizer step bumps them) with those it
last loaded and, when they changed, loads ``effective_state_dict`` into vLLM: the first rollout
after every update syncs, on every rank, inside the same ``gathered()`` block that makes sharded
(FSDP) weights whole.

What this module owns is bookkeeping, tested with a fake backend (``tests/unit/test_engines.py``):
rows ↔ prompts × samples (row ``i * n + k`` = sample k of prompt i), the end token kept on
stopped samples, right padding after it and the completion mask, left-padded prompts, and the
weight versions. ``VLLMBackend`` is the two calls it needs from vLLM.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from lit_marl.agents import Agent
from lit_marl.generation.base import Generation, generate_each, left_pad, mask_through_first
from lit_marl.generation.decoder import effective_state_dict


@dataclass
class Sampling:
    """One generation call's settings, as vLLM's ``SamplingParams`` takes them."""

    n: int
    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    stop_token_ids: list[int]


@dataclass
class Sample:
    token_ids: list[int]
    finish_reason: str  # "stop" (an end/stop token) or "length"


class VLLMBackend(Protocol):
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Sample]]:
        """For each prompt, in order, its ``sampling.n`` samples."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the served weights (transformers' names, full tensors)."""


class LLMBackend:
    """A real ``vllm.LLM`` for one model, in this process (V1 multiprocessing off so the trainer
    can reach the worker's model to load weights)."""

    def __init__(self, source: str, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        kwargs = dict(gpu_memory_utilization=0.3, enable_prefix_caching=True, dtype=compute_dtype())
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per rank, colocated
            kwargs["seed"] = torch.distributed.get_rank()
        kwargs.update(llm_kwargs)
        self.llm = LLM(model=source, **kwargs)

    def generate(self, prompts, sampling):
        from vllm import SamplingParams

        params = SamplingParams(
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=sampling.stop_token_ids,
            detokenize=False,
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[Sample(list(o.token_ids), o.finish_reason) for o in out.outputs] for out in outputs]

    def load_weights(self, weights):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor.driver_worker, "worker", executor.driver_worker)  # V1 wraps the worker
        worker.model_runner.model.load_weights(weights=weights)


def compute_dtype(device_type: str = "cuda") -> str:
    """The dtype the trainer's passes compute in right now, for vLLM's ``dtype``: bf16 inside
    ``trainer.precision: bf16-mixed``'s autocast (rollouts run in it), else float32. vLLM's own
    default (``auto``: the checkpoint's, bf16 for Qwen) would sample an fp32 team from another
    policy than the one the update scores."""
    if torch.is_autocast_enabled(device_type):
        return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return "float32"


def weight_version(model: torch.nn.Module) -> tuple:
    """Changes whenever any parameter is modified in place (optimizer steps) or replaced, or LoRA
    adapters are switched off or on (``disable_adapter``: the initial policy) or another is made active."""
    adapters = tuple(
        (bool(m.disable_adapters), tuple(m.active_adapters)) for m in model.modules() if hasattr(m, "lora_A")
    )
    return tuple((id(p), p._version) for p in model.parameters()), adapters


class VLLMEngine:
    name = "vllm"

    def __init__(self, backend_factory: Callable[[Agent], VLLMBackend] | None = None, **llm_kwargs):
        """``backend_factory(agent)`` makes the backend for one model (default: a ``vllm.LLM`` on
        ``agent.source`` with ``llm_kwargs``, e.g. ``gpu_memory_utilization``, ``max_model_len``)."""
        if backend_factory is None:
            if importlib.util.find_spec("vllm") is None:
                raise ImportError(
                    f"data.engine=vllm: vllm is not installed; on a GPU machine install a vLLM build for "
                    f"torch {torch.__version__}, or use engine: auto"
                )
            backend_factory = lambda agent: LLMBackend(agent.source, **llm_kwargs)  # noqa: E731
        elif llm_kwargs:
            raise ValueError(f"VLLMEngine: {sorted(llm_kwargs)} go to the default backend, not a backend_factory")
        self.backend_factory = backend_factory
        self.llm_kwargs = llm_kwargs  # gpu_memory_utilization: the memory plan counts it
        self.backends: dict[int, VLLMBackend] = {}
        self.versions: dict[int, tuple] = {}
        self.syncs = 0  # weight loads so far (all models)

    def sync(self, agent: Agent) -> VLLMBackend:
        """The backend of ``agent``'s model, holding its current weights."""
        key = id(agent.model)
        if key not in self.backends:
            self.backends[key] = self.backend_factory(agent)
        version = weight_version(agent.model)
        if self.versions.get(key) != version:
            self.backends[key].load_weights(effective_state_dict(agent.model).items())
            self.versions[key] = version
            self.syncs += 1
        return self.backends[key]

    def generate_team(self, calls, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, seeds=None):
        if seeds is not None:
            raise ValueError(f"data.sampling_streams=per_task needs the lean decoder, not the {self.name} engine")
        return generate_each(self, calls, max_new_tokens, temperature, top_p, greedy)

    @torch.no_grad()
    def generate(self, agent, prompts, num_samples, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False):
        backend = self.sync(agent)
        sampling = Sampling(
            n=num_samples,
            max_tokens=max_new_tokens,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            stop_token_ids=[agent.eos_token_id],
        )
        outputs = backend.generate(prompts, sampling)
        if len(outputs) != len(prompts) or any(len(o) != num_samples for o in outputs):
            raise RuntimeError(
                f"vllm returned {[len(o) for o in outputs]} samples for {len(prompts)} prompts × {num_samples}"
            )
        eos = agent.eos_token_id
        rows = []
        for samples in outputs:
            for sample in samples:
                ids = list(sample.token_ids)[:max_new_tokens]
                if sample.finish_reason == "stop" and (not ids or ids[-1] != eos) and len(ids) < max_new_tokens:
                    ids.append(eos)  # the end token that stopped the sample is part of the response
                rows.append(ids)
        device = next(agent.model.parameters()).device
        prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(num_samples)], agent.pad_token_id, device)
        width = max(1, max(len(r) for r in rows))
        completion_ids = torch.full((len(rows), width), agent.pad_token_id, dtype=torch.long, device=device)
        for i, ids in enumerate(rows):
            completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
        completion_mask = mask_through_first(completion_ids, eos)
        lengths = torch.tensor([len(r) for r in rows], device=device)
        completion_mask &= (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        return Generation(prompt_ids, prompt_mask, completion_ids, completion_mask, num_samples)
