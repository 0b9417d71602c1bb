"""The memory plan of a run: what each rank needs before the first step, and an early, named
failure when that cannot fit the device.

Weights, gradients and AdamW's state are counted from the built models (exact bytes per dtype;
FSDP shards counted as the local shard, plus the full weights a step gathers). Activations are
measured, not guessed: ``activation_profile`` runs one forward of a 1- and a 2-layer copy of each
trainable model's architecture (same widths, LoRA adapters and autocast dtype, a 256-token
vocabulary) and counts the tensors autograd saves for the backward; the difference is one
layer's bytes per token, the rest the embedding and norms. The LM head's logits are analytic
(fp32: the logits, their log-softmax, and its gradient: 12 bytes per scored position and vocabulary
entry). A pass of ``forward_token_budget`` tokens then needs ``tokens x (layers x per_layer +
other)`` plus the scored positions' logits; with activation checkpointing, only each layer's input
(the residual stream) and one layer's recompute at a time. Generation needs the KV cache of its
rows (the torch decoder and HF), or the share of the device vLLM is given.

docs/scale.md compares the plan with measured peaks (the tiny model and SmolLM2 on CPU).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.models import store_frozen, trained
from lit_marl.parallel.collectives import all_ranks_max
from lit_marl.parallel.fsdp import shardable_models

GiB = 2**30
LOGIT_BYTES = 12  # per scored position and vocabulary entry: fp32 logits, log-softmax, its gradient
PROFILE_TOKENS = 64
PROFILE_VOCAB = 256


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes autograd keeps for a training pass: per token and per decoder layer, per token for the
    rest (embedding, final norm), per layer whatever the tokens (autocast's bf16 copies of the
    weights), a constant, and per token and layer under checkpointing (the layer's input only)."""

    per_layer_token: float
    other_token: float
    per_layer: float
    other: float
    layer_input: float
    layers: int
    vocab: int

    def pass_bytes(self, tokens: int, scored: int, checkpointing: bool) -> float:
        if checkpointing:  # every layer's input, one layer recomputed at a time
            kept = tokens * (self.layers * self.layer_input + self.per_layer_token) + self.per_layer
        else:
            kept = self.layers * (tokens * self.per_layer_token + self.per_layer)
        return kept + tokens * self.other_token + self.other + scored * self.vocab * LOGIT_BYTES


def _causal_lm(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _saved_bytes(model: nn.Module, autocast: torch.dtype | None, tokens: int) -> int:
    """Bytes of the tensors autograd saves in one forward of ``tokens`` tokens (parameters excluded)."""
    sizes: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    ids = torch.randint(0, PROFILE_VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            model(input_ids=ids, logits_to_keep=1)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in sizes.items() if ptr not in weights)


_PROFILES: dict[tuple, ActivationProfile] = {}  # one measurement per architecture, adapters and dtypes


def activation_profile(model: nn.Module, autocast: torch.dtype | None = None) -> ActivationProfile:
    """Measure ``model``'s activation bytes per token on small CPU copies of its architecture."""
    lm = _causal_lm(model)
    config = lm.config
    peft = getattr(model, "peft_config", None)
    frozen = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    key = (config.to_json_string(), repr(peft), autocast, tuple(frozen))
    if key not in _PROFILES:
        _PROFILES[key] = _measure(model, lm, config, peft, autocast)
    return _PROFILES[key]


def _measure(model: nn.Module, lm: nn.Module, config, peft, autocast: torch.dtype | None) -> ActivationProfile:
    from transformers import AutoModelForCausalLM

    counts = {}
    for layers in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers, small.vocab_size = layers, PROFILE_VOCAB
        if getattr(small, "layer_types", None) is not None:
            small.layer_types = small.layer_types[:layers]
        with torch.random.fork_rng(devices=[]):  # sdpa: the run's kernel may not run on a CPU (flash)
            copy_ = AutoModelForCausalLM.from_config(small, dtype=torch.float32, attn_implementation="sdpa")
            copy_ = copy_.eval()
            if peft:
                from peft import get_peft_model

                copy_ = get_peft_model(copy_, copy.deepcopy(next(iter(peft.values())))).eval()
        _match_dtypes(copy_, model)
        for tokens in (PROFILE_TOKENS // 2, PROFILE_TOKENS):
            counts[layers, tokens] = _saved_bytes(copy_, autocast, tokens)
    t1, t2 = PROFILE_TOKENS // 2, PROFILE_TOKENS
    layer_at = {t: counts[2, t] - counts[1, t] for t in (t1, t2)}
    per_layer_token = (layer_at[t2] - layer_at[t1]) / (t2 - t1)
    per_layer = layer_at[t2] - t2 * per_layer_token
    other_token = (counts[1, t2] - counts[1, t1]) / (t2 - t1) - per_layer_token
    embed = lm.get_input_embeddings().weight
    return ActivationProfile(
        per_layer_token=per_layer_token,
        other_token=other_token,
        per_layer=per_layer,
        other=counts[1, t2] - t2 * (per_layer_token + other_token) - per_layer,
        layer_input=config.hidden_size * embed.element_size(),  # the residual stream, as embedded
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
    )


def _match_dtypes(small: nn.Module, model: nn.Module) -> None:
    """The small copy stores its frozen weights as ``model`` does (``model.weights_dtype``)."""
    if any(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad):
        store_frozen(small, "bfloat16")


@dataclass
class MemoryPlan:
    """Bytes per rank, by component; ``peak`` is what the busiest moment of a step needs."""

    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    capacity: float | None = None  # bytes the device has for this rank (None: unknown)

    @property
    def peak(self) -> float:
        p = self.parts
        update = p.get("gradients", 0) + p.get("activations of one update pass", 0)
        rollout = p.get("generation KV cache", 0)  # vLLM's share is held throughout: steady
        steady = sum(v for k, v in p.items() if k not in {"gradients", "activations of one update pass"})
        return steady - rollout + max(update, rollout)

    def table(self) -> str:
        lines = [f"memory plan per rank ({self.device}):"]
        lines += [f"  {name:<34} {size / GiB:8.2f} GiB" for name, size in self.parts.items()]
        have = f" of {self.capacity / GiB:.2f} GiB" if self.capacity else ""
        lines.append(f"  {'peak (update or rollout)':<34} {self.peak / GiB:8.2f} GiB{have}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def weight_parts(module: nn.Module, shard_over: int = 1) -> dict[str, float]:
    """Resident weights (local shards), the full weights a step gathers (FSDP), gradients (fp32,
    unsharded while a step accumulates them) and AdamW's two moments (sharded like the weights).
    ``shard_over``: plan unsharded models as FSDP2 over that many ranks will shard them."""
    named = list({id(p): (n, p) for n, p in module.named_parameters()}.values())
    params = [p for _, p in named]
    resident = sum(_local_numel(p) * p.element_size() / shard_over for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    learned = [p for n, p in named if trained(n, p)]
    return {
        "weights": resident,
        "weights gathered for a step": full - resident,
        "gradients": sum(p.numel() * 4 for p in learned),
        "AdamW state": sum(_local_numel(p) * 8 / shard_over for p in learned),
    }


def kv_cache_bytes(model: nn.Module, rows: int, tokens: int, dtype: torch.dtype) -> float:
    """The KV cache of ``rows`` sequences of ``tokens`` (keys and values, every layer)."""
    config = _causal_lm(model).config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2.0 * config.num_hidden_layers * heads * head_dim * rows * tokens * torch.finfo(dtype).bits / 8


def device_capacity(device: torch.device, ranks_here: int = 1) -> float | None:
    """Bytes this rank may use: the GPU's total memory, or on CPU the machine's memory divided among
    the ``ranks_here`` ranks on it."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total / max(ranks_here, 1)


def _rss() -> float:
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0


_RSS_AT_IMPORT = _rss()  # Python, torch, transformers and Lightning loaded; no model yet (base.py imports this)


def process_overhead(device: torch.device, weights: float) -> float:
    """What the process holds besides the weights now: on CPU its resident memory minus the weights
    (Python, torch, the data), at least what it held before any model loaded (weights read from a
    safetensors file are mapped, and resident only once touched); on a GPU the allocator's reserve
    beyond what is allocated."""
    if device.type == "cuda":
        return float(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return max(_rss() - weights, _RSS_AT_IMPORT)


def generation_shape(data) -> tuple[int, int, str] | None:
    """The most rows one generate call of a training step holds for one agent and their tokens, with
    the assumption made; None for a data module that is neither episodes nor trees."""
    hp = data.hparams
    if hasattr(data, "episode"):  # episodes: every task's group plays at once, contexts up to the cap
        return hp.tasks_per_step * data.episode.group_size, data.episode.max_context_tokens, "max_context_tokens"
    tree = getattr(data, "tree", None)  # the last turn's call: every node's G samples (cross: all agents' nodes)
    if tree is None:
        return None
    nodes = tree.num_generations ** ((tree.num_turns - 1) * (data.num_agents if tree.joint_mode == "cross" else 1))
    return hp.tasks_per_step * nodes * tree.num_generations, 512 + tree.max_new_tokens, "prompts <= 512 tokens"


def plan(
    module,
    data=None,
    shard_over: int = 1,
    vllm_share: float | None = None,
    process: float | None = None,
    capacity: float | None = None,
    autocast: bool | None = None,
) -> MemoryPlan:
    """The memory plan of ``module`` (built, sharded where it will be) for a step of ``data``. The
    keywords plan ahead for other hardware (``scripts/plan_memory.py``): ``shard_over`` ranks of FSDP2,
    vLLM's ``gpu_memory_utilization``, the runtime's bytes, the device's, bf16 autocast; by default
    each is read from the run."""
    device = module.device
    if autocast is None:
        precision = str(module._trainer.precision) if module._trainer is not None else "32-true"
        autocast = precision.startswith("bf16") or getattr(module, "weights_dtype", "float32") == "bfloat16"
    dtype = torch.bfloat16 if autocast else None
    if capacity is None:
        trainer = module._trainer
        ranks_here = trainer.num_devices if trainer is not None and device.type == "cpu" else 1
        capacity = device_capacity(device, ranks_here)
    result = MemoryPlan(device=str(device), capacity=capacity)
    parts = weight_parts(module, shard_over)
    result.parts["process (runtime, data)"] = (
        process if process is not None else process_overhead(device, parts["weights"])
    )
    result.parts.update(parts)
    result.parts["activations of one update pass"] = _pass_bytes(module, dtype, result.notes)
    engine = getattr(getattr(data, "engine", None), "name", None)
    agents = list(module.agents) if module.agents is not None else []
    models = list({id(agent.model): agent.model for agent in agents}.values())  # one engine per model
    if vllm_share is None and engine == "vllm":
        options = data.engine.options(device.type)
        if "kv_cache_memory_bytes" in options:  # a fixed KV budget (CPU's default) beside its own weights
            served = sum(p.numel() for m in models for p in m.parameters()) * (2 if autocast else 4)
            result.parts["vLLM engines (KV budget, weights)"] = len(models) * options["kv_cache_memory_bytes"] + served
        else:
            vllm_share = float(options["gpu_memory_utilization"])
    if vllm_share is not None:
        result.parts["vLLM engines (gpu_memory_utilization)"] = vllm_share * len(models) * (result.capacity or 0)
    elif engine != "vllm" and data is not None and agents and (shape := generation_shape(data)) is not None:
        rows, length, assumed = shape
        # the lean decoder stacks every agent's call of a turn into one: all roles' rows at once
        kv = kv_cache_bytes(agents[0].model, rows * len(agents), length, dtype or torch.float32)
        result.parts["generation KV cache"] = kv
        result.notes.append(f"generation: {len(agents)} agents x {rows} rows x {length} tokens ({assumed})")
    return result


def _pass_bytes(module, dtype: torch.dtype | None, notes: list[str]) -> float:
    """One update pass: the largest policy pass (every position scored), plus every other trained
    model's (critic backbones, reward models: no logits), since an actor-critic update runs policy
    and critic in one graph."""
    tokens = module.forward_token_budget
    if tokens is None:
        notes.append("model.forward_token_budget is null: a pass's activations are unbounded, not counted")
        return 0.0
    policies = {id(agent.model) for agent in module.agents or []}
    checkpointing = module.activation_checkpointing
    policy, others = [0.0], 0.0
    for model in shardable_models(module):
        if not any(trained(n, p) for n, p in model.named_parameters()):
            continue
        is_policy = id(model) in policies or any(id(m) in policies for m in model.modules())
        size = activation_profile(model, dtype).pass_bytes(tokens, tokens if is_policy else 0, checkpointing)
        if is_policy:
            policy.append(size)
        else:
            others += size
    notes.append(f"a pass of {tokens} tokens, every position scored (an upper bound on the logits)")
    return max(policy) + others


def check_memory(module, data=None) -> MemoryPlan:
    """Print the plan (rank 0) and fail before the first step, naming the settings that shrink the
    largest parts, when its peak exceeds the device."""
    from lightning.pytorch.utilities import rank_zero_info

    result = plan(module, data)
    rank_zero_info(result.table())
    # every rank decides alike (one rank stopping alone would leave the others waiting in a collective)
    over = all_ranks_max(result.peak - result.capacity if result.capacity is not None else -1.0, module.device)
    if over <= 0:
        return result
    fixes = {
        "activations of one update pass": "lower model.forward_token_budget, or model.activation_checkpointing: true",
        "gradients": "train LoRA adapters (model.lora) or shard over more ranks (TeamFSDPStrategy)",
        "AdamW state": "train LoRA adapters (model.lora) or shard over more ranks (TeamFSDPStrategy)",
        "weights": "set model.weights_dtype: bfloat16, model.lora_shared_base: true, or shard over more ranks",
        "generation KV cache": "lower data.tasks_per_step, data.num_generations or the context",
        "vLLM engines (gpu_memory_utilization)": "lower gpu_memory_utilization in data.engine_options",
        "vLLM engines (KV budget, weights)": "lower kv_cache_memory_bytes in data.engine_options",
    }
    largest = sorted((name for name in result.parts if name in fixes), key=lambda n: -result.parts[n])[:2]
    advice = "; ".join(f"{name} ({result.parts[name] / GiB:.2f} GiB): {fixes[name]}" for name in largest)
    raise ConfigError(
        f"the memory plan needs {result.peak / GiB:.2f} GiB on this rank at its peak (the fullest rank "
        f"{over / GiB:.2f} GiB more than its device), the device has {(result.capacity or 0) / GiB:.2f} GiB. "
        f"Largest: {advice}. (model.memory_check: false skips this check)\n" + result.table()
    )
