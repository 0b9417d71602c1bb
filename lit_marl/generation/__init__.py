"""Batched generation that keeps token ids, behind one engine interface.

One call generates for every prompt of every open node at once (prompts left-padded), so a turn
costs one ``generate`` per agent, never one per node.

Generation sits behind one small interface, ``Engine.generate(agent, prompts, num_samples,
sampling) -> Generation`` (``sampling``: the ``Sampling`` group, ``data.sampling``):

- ``hf``: transformers' ``generate`` (any model);
- ``torch``: ``generation/decoder.py``'s lean KV-cache decoder for Llama-family models (Llama, Qwen2),
  2-3x faster than ``generate`` on small models, where a token's time is Python overhead; in a
  rollout block it keeps each sequence's KV cache for the next turn (``generation/kept.py``,
  ``data.engine_options: {kept_kv_gib: ...}``);
- ``auto`` (default): ``torch`` where the model supports it, else ``hf``, decided per call;
- ``vllm``: ``generation/vllm.py`` (optional: ``make vllm`` on CPU, a vLLM build on GPU), colocated in
  the trainer's ranks, weights synced from the trainer;
- ``vllm_server``: ``generation/server.py``, vLLM servers on GPUs of their own (tensor/data parallel),
  started by the run or running already, weights sent by vLLM's weight transfer protocol.

Engines return token ids and the log-prob they computed for each sampled token. The log-probs a
loss differentiates are always recomputed by the trainer's own forward (``lit_marl/logprobs.py``);
the engine's are compared with them (logged) and, with ``model.update.rollout_is_cap``, weigh the policy
terms by truncated importance sampling (``losses.truncated_is_weights``).
"""

from __future__ import annotations

from lit_marl.generation.base import (
    Engine,
    Generation,
    GenerationCall,
    Sampling,
    generate_each,
    left_pad,
    mask_through_first,
)
from lit_marl.generation.hf import HFEngine, generate
from lit_marl.generation.lean import TorchEngine
from lit_marl.generation.server import VLLMServerEngine

__all__ = [
    "ENGINES",
    "Engine",
    "Generation",
    "GenerationCall",
    "HFEngine",
    "Sampling",
    "TorchEngine",
    "VLLMServerEngine",
    "generate",
    "generate_each",
    "left_pad",
    "make_engine",
    "mask_through_first",
]


ENGINES = ("auto", "torch", "hf", "vllm", "vllm_server")


def make_engine(name: str = "auto", options: dict | None = None, field: str = "data.engine") -> Engine:
    """The engine called ``name``; ``options`` go to its constructor (vLLM's settings)."""
    options = dict(options or {})
    if name == "vllm":
        from lit_marl.generation.vllm import VLLMEngine  # deferred: vLLM is an optional engine

        return VLLMEngine(**options)
    if name == "vllm_server":
        return VLLMServerEngine(**options)
    if name == "hf":
        if options:
            raise ValueError(f"{field}_options={options}: the hf engine takes none")
        return HFEngine()
    if name in ("torch", "auto"):
        unknown = set(options) - {"kept_kv_gib"}
        if unknown:
            raise ValueError(f"{field}_options: {sorted(unknown)} unknown to the {name} engine (it takes kept_kv_gib)")
        return TorchEngine(fallback=name == "auto", **options)
    raise ValueError(f"{field}={name!r}: choose one of {', '.join(ENGINES)}")
