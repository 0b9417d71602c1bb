"""The trainer's weights as an engine reads them: ``weight_version`` (changes with any in-place change,
replacement or adapter switch: when a copy or a cache made from them is stale) and
``effective_weights`` (the plain causal LM's weights, LoRA merged, one tensor at a time: what an engine
that holds its own copy loads after each update)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from lit_marl.generation.decoder import _causal_lm, _linear


def weight_version(model: torch.nn.Module, part: Callable[[str], bool] | None = None) -> tuple:
    """Changes whenever any parameter (of those whose name ``part`` accepts) is modified in place
    (optimizer steps, FSDP gathers) or replaced, or LoRA adapters are switched off or on
    (``disable_adapter``: the initial policy) or another is made active."""
    adapters = tuple(
        (bool(m.disable_adapters), tuple(m.active_adapters)) for m in model.modules() if hasattr(m, "lora_A")
    )
    named = model.named_parameters()
    return tuple((id(p), p._version) for n, p in named if part is None or part(n)), adapters if part is None else ()


def effective_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain causal LM's weights (transformers' names), one tensor at a time, with the active
    LoRA adapters merged into the weights they adapt: what an inference engine that holds its own
    copy of the weights (vLLM) loads after each update. Sharded (DTensor) parameters are gathered one
    at a time (the same all-gathers in the same order on every rank) and ``dtype`` casts each tensor
    as it is produced, so at most one tensor is copied at once (the stream's bucket is one tensor:
    7B's largest, its embedding, is 1.0 GiB in bf16); a model gathered whole is read as it is,
    without a collective or a reshard; a weight shared by two names (tied embeddings) is made once
    and sent under both (vLLM's CPU kernels keep the LM head packed apart from the embedding: it
    must receive its weight). ``served_metadata`` lists the same names, in the same order, without
    reading a value."""
    tied: dict[int, torch.Tensor] = {}
    for name, tensor, owner, shared in _served_entries(model):
        if owner is not None:
            weight, bias = _linear(owner)
            yield name, _served(weight if name.endswith(".weight") else bias, dtype)
        elif shared:
            if id(tensor) not in tied:
                tied[id(tensor)] = _served(tensor, dtype)
            yield name, tied[id(tensor)]
        else:
            yield name, _served(tensor, dtype)


def served_metadata(model: nn.Module, dtype: torch.dtype | None = None) -> list[tuple[str, torch.dtype, tuple]]:
    """``(name, dtype, shape)`` of every tensor ``effective_weights`` yields, in its order, read from the
    parameters (a sharded one's global shape) without gathering or merging anything: what a transfer
    protocol declares before it streams the tensors (vLLM's ``update_info``)."""
    return [
        (name, dtype or tensor.dtype, tuple(tensor.shape)) for name, tensor, _owner, _shared in _served_entries(model)
    ]


def _served_entries(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, nn.Module | None, bool]]:
    """Per served weight: its name, the trainer's tensor (a LoRA layer's base weight or bias: the
    merged one has its shape), the LoRA layer that merges it (None: served as it is), and whether
    another name shares the tensor (tied weights)."""
    lm = _causal_lm(model)
    adapted = {name: module for name, module in lm.named_modules() if hasattr(module, "base_layer")}
    state = _state(lm)
    names_of: dict[int, int] = {}
    for tensor in state.values():
        names_of[id(tensor)] = names_of.get(id(tensor), 0) + 1
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        owner = next((m for prefix, m in adapted.items() if name.startswith(prefix + ".base_layer.")), None)
        if owner is not None:
            yield name.replace(".base_layer.", "."), tensor, owner, False
        else:
            yield name, tensor, None, names_of[id(tensor)] > 1


def _state(lm: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict(keep_vars=True)``'s names and tensors (tied weights under each name, persistent
    buffers), read without its hooks: FSDP2's would reshard a gathered model."""
    state = dict(lm.named_parameters(remove_duplicate=False))
    for prefix, module in lm.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = buffer
    return state


def _served(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` whole in ``dtype``; a shard is cast before it is gathered (the same values: the cast
    is elementwise), so the gather moves the serving dtype's bytes and the whole tensor exists once."""
    tensor = tensor.detach() if dtype is None else tensor.detach().to(dtype)
    return tensor.full_tensor() if type(tensor).__name__ == "DTensor" else tensor
