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
from lit_marl.agents import AdapterView
from lit_marl.models import store_frozen, trained
from lit_marl.parallel.collectives import all_ranks_max
from lit_marl.parallel.fsdp import shardable_models, unit_modules
from lit_marl.parallel.strategies import TeamFSDPStrategy

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


UPDATE, ROLLOUT = "update", "rollout"


@dataclass
class MemoryPlan:
    """Bytes per rank, by component; each part is held through the whole step or only in its
    phase (``phases``: the update, or the rollout); ``peak`` is the fuller of the two phases."""

    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    capacity: float | None = None  # bytes the device has for this rank (None: unknown)
    phases: dict[str, str] = field(default_factory=dict)  # part -> UPDATE or ROLLOUT (absent: both)
    mode: str | None = None  # FSDP2's mode (None: not sharded)

    def phase(self, name: str) -> float:
        """What the step holds in phase ``name`` (update or rollout)."""
        return sum(v for k, v in self.parts.items() if self.phases.get(k, name) == name)

    @property
    def peak(self) -> float:
        return max(self.phase(UPDATE), self.phase(ROLLOUT))

    def table(self) -> str:
        mode = f", FSDP2 {self.mode}" if self.mode else ""
        lines = [f"memory plan per rank ({self.device}{mode}):"]
        for name, size in self.parts.items():
            lines.append(
                f"  {name:<40} {size / GiB:8.2f} GiB" + (f"  ({self.phases[name]})" if name in self.phases else "")
            )
        have = f" of {self.capacity / GiB:.2f} GiB" if self.capacity else ""
        lines.append(
            f"  {'update / rollout':<40} {self.phase(UPDATE) / GiB:8.2f} / {self.phase(ROLLOUT) / GiB:.2f} GiB"
        )
        lines.append(f"  {'peak':<40} {self.peak / GiB:8.2f} GiB{have}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def weight_parts(module: nn.Module, shard_over: int = 1, mode: str = "gathered") -> tuple[dict, dict]:
    """The weight-sized parts and their phases: resident weights (local shards), AdamW's two
    moments (sharded like the weights), gradients (fp32) and the full weights FSDP gathers.
    ``gathered``: every model whole through the step, gradients unsharded while they accumulate.
    ``per_layer``: two units (the computing layer and the prefetched next) and each root's own
    parameters whole in a pass, their gradients unsharded until reduced, the rest of the
    gradients sharded; the rollout gathers the whole models (generation with torch/hf).
    ``shard_over``: plan unsharded models as FSDP2 over that many ranks will shard them."""
    named = list({id(p): (n, p) for n, p in module.named_parameters()}.values())
    params = [p for _, p in named]
    resident = sum(_local_numel(p) * p.element_size() / shard_over for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    learned = [p for n, p in named if trained(n, p)]
    parts = {"weights": resident, "AdamW state": sum(_local_numel(p) * 8 / shard_over for p in learned)}
    if mode != "per_layer":
        parts["weights gathered for a step"] = full - resident
        parts["gradients"] = sum(p.numel() * 4 for p in learned)
        return parts, {"gradients": UPDATE}
    sharded = 1 - 1 / _world_of(params, shard_over)
    units = [unit for model in shardable_models(module) for unit in fsdp_units(model)]
    learned_ids = {id(p) for p in learned}

    def size(unit):
        return sum(p.numel() * p.element_size() for p in unit), sum(p.numel() * 4 for p in unit if id(p) in learned_ids)

    roots = [size(unit) for unit, is_root in units if is_root]
    others = sorted((size(unit) for unit, is_root in units if not is_root), reverse=True)[:2]
    parts["layers gathered in a pass"] = sharded * (sum(w for w, _ in roots) + sum(w for w, _ in others))
    parts["gradients"] = sum(_local_numel(p) * 4 / shard_over for p in learned) + sharded * (
        sum(g for _, g in roots) + sum(g for _, g in others)
    )
    parts["weights gathered for generation"] = full - resident
    return parts, {"layers gathered in a pass": UPDATE, "gradients": UPDATE, "weights gathered for generation": ROLLOUT}


def _world_of(params: list[torch.Tensor], shard_over: int) -> int:
    """The ranks the parameters are (or will be) sharded over."""
    for p in params:
        if hasattr(p, "device_mesh"):
            return p.device_mesh.size()
    return shard_over


def fsdp_units(model: nn.Module) -> list[tuple[list[torch.Tensor], bool]]:
    """The parameters of each FSDP2 unit ``per_layer`` makes of ``model`` (its decoder layers, its
    untied embedding and head, the rest: the root, flagged True)."""
    layers, edges = unit_modules(model)
    taken: set[int] = set()
    units = []
    for m in layers + edges:
        own = [p for p in m.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        units.append((own, False))
    units.append(([p for p in model.parameters() if id(p) not in taken], True))
    return units


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


def plan(
    module,
    rollout=None,
    shard_over: int = 1,
    vllm_share: float | None = None,
    process: float | None = None,
    capacity: float | None = None,
    autocast: bool | None = None,
    mode: str | None = None,
    vllm_options: dict | None = None,
) -> MemoryPlan:
    """The memory plan of ``module`` (built, sharded where it will be) for a step of ``rollout`` (the
    data module's ``RolloutSettings``; None: no generation planned). The
    keywords plan ahead for other hardware (``scripts/plan_memory.py``): ``shard_over`` ranks of FSDP2
    in ``mode`` (gathered or per_layer), vLLM's ``gpu_memory_utilization`` and options
    (``VLLMEngine.options`` of the device it will run on),
    the runtime's bytes, the device's, bf16 autocast; by default each is read from the run."""
    device = module.device
    if autocast is None:
        precision = str(module._trainer.precision) if module._trainer is not None else "32-true"
        autocast = precision.startswith("bf16") or getattr(module, "weights_dtype", "float32") == "bfloat16"
    dtype = torch.bfloat16 if autocast else None
    if capacity is None:
        trainer = module._trainer
        ranks_here = trainer.num_devices if trainer is not None and device.type == "cpu" else 1
        capacity = device_capacity(device, ranks_here)
    if mode is None:
        mode = module.shards.mode if module.shards is not None else None
    sharded = mode is not None or shard_over > 1
    result = MemoryPlan(device=str(device), capacity=capacity, mode=(mode or "gathered") if sharded else None)
    parts, phases = weight_parts(module, shard_over, mode or "gathered")
    result.parts["process (runtime, data)"] = (
        process if process is not None else process_overhead(device, parts["weights"])
    )
    result.parts.update(parts)
    result.phases.update(phases)
    result.parts["activations of one update pass"] = _pass_bytes(module, dtype, result.notes)
    result.phases["activations of one update pass"] = UPDATE
    engine = rollout.engine.name if rollout is not None else None
    agents = list(module.agents) if module.agents is not None else []
    # one engine per model; a team's LoRA adapters on one base share its engine
    served = [agent.model.shared if isinstance(agent.model, AdapterView) else agent.model for agent in agents]
    models = list({id(model): model for model in served}.values())
    shape = rollout.generation_shape() if rollout is not None and agents else None
    if engine == "vllm":
        result.parts.pop("weights gathered for generation", None)  # vLLM holds its own copy
        options = vllm_options if vllm_options is not None else rollout.engine.options(device.type)
        _vllm_parts(result, options, models, shape, vllm_share, dtype)
    elif shape is not None:
        rows, length, assumed = shape
        # the lean decoder stacks every agent's call of a turn into one: all roles' rows at once
        result.parts["generation KV cache"] = kv_cache_bytes(
            agents[0].model, rows * len(agents), length, dtype or torch.float32
        )
        result.phases["generation KV cache"] = ROLLOUT
        result.notes.append(f"generation: {len(agents)} agents x {rows} rows x {length} tokens ({assumed})")
    return result


VLLM_OVERHEAD = 2 * GiB  # per GPU instance: CUDA graphs, sampler, activations of the largest batch


def _vllm_parts(result: MemoryPlan, options: dict, models: list, shape, share: float | None, dtype) -> None:
    """vLLM's instances: on CPU a fixed KV budget beside their weights; on a GPU the share they are
    given (``share``, else the options'), with a note where that is less than they need (weights /
    tensor-parallel ranks + the KV cache of the step's generation shape + ~2 GiB). Asleep during the
    update with ``enable_sleep_mode`` (weights and KV freed)."""
    served = sum(p.numel() for m in models for p in m.parameters()) * (2 if dtype is not None else 4)
    if share is None and "kv_cache_memory_bytes" in options:
        name = "vLLM engines (KV budget, weights)"
        result.parts[name] = len(models) * options["kv_cache_memory_bytes"] + served
    else:
        name = "vLLM engines (gpu_memory_utilization)"
        result.parts[name] = (share or options["gpu_memory_utilization"]) * len(models) * (result.capacity or 0)
        tp = int(options.get("tensor_parallel_size", 1))
        kv = sum(kv_cache_bytes(m, shape[0], shape[1], dtype or torch.float32) for m in models) if shape else 0.0
        need = (served + kv) / tp + len(models) * VLLM_OVERHEAD
        if result.capacity and need > result.parts[name]:
            result.notes.append(
                f"vLLM needs ~{need / GiB:.1f} GiB (weights / TP, KV, overhead): raise gpu_memory_utilization"
            )
    if options.get("enable_sleep_mode"):
        result.phases[name] = ROLLOUT


def fsdp_settings(module, strategy, ranks: int) -> tuple[str, str]:
    """FSDP2's mode and gather dtype for ``module`` under ``strategy`` (``TeamFSDPStrategy``'s, or
    gathered for Lightning's own ``ModelParallelStrategy``), ``auto`` resolved by ``choose_mode``."""
    if not isinstance(strategy, TeamFSDPStrategy):
        return "gathered", "float32"
    if strategy.mode != "auto":
        return strategy.mode, strategy.gather_dtype
    mode = choose_mode(module, module.rollout_settings, ranks, strategy.root_device)
    return mode, strategy.gather_dtype if mode == "per_layer" else "float32"


def choose_mode(module, rollout, ranks: int, device: torch.device) -> str:
    """FSDP2's mode under ``auto``: ``gathered`` (least traffic) when its plan fits the device on
    every rank, else ``per_layer``. Every rank decides alike."""
    from lightning.pytorch.utilities import rank_zero_info

    trainer = module._trainer
    ranks_here = trainer.num_devices if trainer is not None and device.type == "cpu" else 1
    capacity = device_capacity(device, ranks_here)
    whole = plan(module, rollout, shard_over=ranks, capacity=capacity, mode="gathered")
    over = all_ranks_max(whole.peak - capacity if capacity is not None else -1.0, device)
    mode = "gathered" if over <= 0 else "per_layer"
    rank_zero_info(
        f"FSDP2 mode auto: {mode} (gathered needs {whole.peak / GiB:.2f} GiB of {(capacity or 0) / GiB:.2f})"
    )
    return mode


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


def check_memory(module, rollout=None) -> MemoryPlan:
    """Print the plan (rank 0) and fail before the first step, naming the settings that shrink the
    largest parts, when its peak exceeds the device."""
    from lightning.pytorch.utilities import rank_zero_info

    result = plan(module, rollout)
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
        "weights gathered for a step": "use per-layer FSDP2 (trainer.strategy.init_args.mode: per_layer)",
        "layers gathered in a pass": "set trainer.strategy.init_args.gather_dtype: bfloat16",
        "weights gathered for generation": "generate with vLLM (data.engine: vllm)",
    }
    fuller = UPDATE if result.phase(UPDATE) >= result.phase(ROLLOUT) else ROLLOUT
    held = [name for name in result.parts if name in fixes and result.phases.get(name, fuller) == fuller]
    largest = sorted(held, key=lambda n: -result.parts[n])[:2]
    advice = "; ".join(f"{name} ({result.parts[name] / GiB:.2f} GiB): {fixes[name]}" for name in largest)
    raise ConfigError(
        f"the memory plan needs {result.peak / GiB:.2f} GiB on this rank at its peak (the {fuller}; the fullest rank "
        f"{over / GiB:.2f} GiB more than its device), the device has {(result.capacity or 0) / GiB:.2f} GiB. "
        f"Largest: {advice}. (model.memory_check: false skips this check)\n" + result.table()
    )
