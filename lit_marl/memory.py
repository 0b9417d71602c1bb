"""The memory plan of a run: what each rank holds in every phase it goes through, and an early,
named failure when that cannot fit the device.

The phases: **setup** (the models loaded and sharded: rank 0 loads every weight, the others build
on the meta device and receive their shards), **rollout** (generation: vLLM awake, or the KV cache
of the torch/HF decoders and, under per-layer FSDP, the models they generate with gathered whole),
**evaluation** (the held-out rollouts, through the same engine, at the evaluation's shape) and
**update** (gradients, one pass's activations and, per layer, the units gathered while they
compute; references, critics and old log-probs are scored in the same lockstep passes). A part is
held in the phases it names; the peak is the fullest phase.

Weights, gradients and AdamW's state are counted from the built models (exact bytes per dtype;
FSDP shards counted as the local shard, plus the full weights a phase gathers). Activations are
measured (``lit_marl.activations``). On a GPU the plan adds what torch's allocator does not count
(the CUDA context and NCCL's buffers, fragmentation of its cache, what a sleeping vLLM keeps).

docs/scale.md compares the plan with measured peaks (the tiny model and SmolLM2 on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.activations import update_pass_bytes
from lit_marl.agents import AdapterView
from lit_marl.models import causal_lm, trained
from lit_marl.parallel.collectives import all_ranks_max
from lit_marl.parallel.fsdp import roots_in, shardable_models, unit_modules
from lit_marl.parallel.strategies import TeamFSDPStrategy

GiB = 2**30

SETUP, ROLLOUT, EVALUATION, UPDATE = "setup", "rollout", "evaluation", "update"
PHASES = (SETUP, ROLLOUT, EVALUATION, UPDATE)
STEPS = (ROLLOUT, EVALUATION, UPDATE)  # from the first step on (the first evaluation included)
GENERATION = (ROLLOUT, EVALUATION)

# What a GPU holds beyond torch's allocated bytes (estimates from the peers' reports;
# scripts/gpu_check_scale.py measures the context and the allocator's reserve on a GPU)
CUDA_CONTEXT = 0.6 * GiB  # the CUDA context and its kernels' modules, per process
NCCL_BUFFERS = 0.5 * GiB  # NCCL's channel buffers of the data-parallel communicator
FRAGMENTATION = 0.10  # the caching allocator's reserve over its allocated bytes (reserved / allocated - 1)
VLLM_ASLEEP = 1.0 * GiB  # per sleeping vLLM engine: CUDA graphs, its allocator's pools, sampler buffers
VLLM_OVERHEAD = 2 * GiB  # per awake GPU instance: CUDA graphs, sampler, activations of the largest batch


@dataclass
class MemoryPlan:
    """Bytes per rank, by part; each part is held in the phases ``phases`` names (absent: every
    phase); a phase holds the sum of its parts (on a GPU plus ``fragmentation`` of what torch's
    allocator holds); ``peak`` is the fullest phase. ``gathered``: per phase, the models the plan
    holds whole (their names in the module); ``host``: host memory at setup, rank 0 and the others."""

    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    device: str = "cpu"
    capacity: float | None = None  # bytes the device has for this rank (None: unknown)
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mode: str | None = None  # FSDP2's mode (None: not sharded)
    fragmentation: float = 0.0
    gathered: dict[str, list[str]] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    short: list[str] = field(default_factory=list)  # what cannot work whatever the peak (vLLM's share)
    outside: set[str] = field(default_factory=set)  # parts torch's allocator does not hold (no fragmentation)

    def held(self, name: str) -> list[str]:
        """The parts held in phase ``name``."""
        return [k for k in self.parts if name in self.phases.get(k, PHASES)]

    def reserve(self, name: str) -> float:
        """The allocator's fragmentation in phase ``name``: a share of the bytes torch allocates."""
        return self.fragmentation * sum(self.parts[k] for k in self.held(name) if k not in self.outside)

    def phase(self, name: str) -> float:
        """What phase ``name`` holds (setup, rollout, evaluation or update)."""
        return sum(self.parts[k] for k in self.held(name)) + self.reserve(name)

    @property
    def fullest(self) -> str:
        return max(PHASES, key=self.phase)

    @property
    def peak(self) -> float:
        return self.phase(self.fullest)

    def table(self) -> str:
        mode = f", FSDP2 {self.mode}" if self.mode else ""
        lines = [f"memory plan per rank ({self.device}{mode}):"]
        for name, size in self.parts.items():
            held = self.phases.get(name, PHASES)
            lines.append(f"  {name:<40} {size / GiB:8.2f} GiB" + (f"  ({', '.join(held)})" if held != PHASES else ""))
        if self.fragmentation:
            lines.append(f"  {f'allocator fragmentation ({self.fragmentation:.0%})':<40} (in each phase below)")
        have = f" of {self.capacity / GiB:.2f} GiB" if self.capacity else ""
        lines.append(f"  {' / '.join(PHASES):<40} " + " / ".join(f"{self.phase(p) / GiB:.2f}" for p in PHASES) + " GiB")
        lines.append(f"  {'peak':<40} {self.peak / GiB:8.2f} GiB{have}  ({self.fullest})")
        if self.host:
            lines.append("  host memory at setup: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in self.host.items()))
        lines += [f"  note: {n}" for n in self.notes + self.short]
        return "\n".join(lines)


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _bytes(params) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


def _unique(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list({id(p): (n, p) for n, p in module.named_parameters()}.values())


def weight_parts(
    module: nn.Module,
    shard_over: int = 1,
    mode: str = "gathered",
    generation: list[nn.Module] | None = None,
    gather_dtype: str = "float32",
) -> tuple[dict, dict]:
    """The weight-sized parts and their phases: resident weights (local shards), AdamW's two
    moments (sharded like the weights, from the first step on), gradients (fp32) and what FSDP2
    gathers. A gathered unit is a whole copy beside the shards (measured: holding a 496 MiB model whole
    on 2 ranks adds 497 MiB), and gathering it passes through an all-gather buffer of its size.
    ``gathered``: every model whole from the first step on, gradients unsharded while they
    accumulate. ``per_layer``: each root's own parameters and the two adjacent units that are whole
    together in a pass (the one computing and the one prefetched, in forward order: embedding, layers,
    head; decoder layers in ``gather_dtype``; one model's units at a time) whole in an update pass,
    their gradients unsharded until reduced, the rest of the gradients sharded; the ``generation``
    models (those the torch/HF decoders generate with; none when vLLM serves them) whole in rollouts
    and evaluations. ``shard_over``: plan unsharded models as FSDP2 over that many ranks will shard them."""
    named = _unique(module)
    params = [p for _, p in named]
    resident = sum(_local_numel(p) * p.element_size() / shard_over for p in params)
    learned = [p for n, p in named if trained(n, p)]
    learned_ids = {id(p) for p in learned}
    parts = {"weights": resident, "AdamW state": sum(_local_numel(p) * 8 / shard_over for p in learned)}
    phases = {"AdamW state": STEPS, "gradients": (UPDATE,)}
    sharded = _world_of(params, shard_over) > 1  # else nothing is gathered: the weights are whole
    low = torch.finfo(getattr(torch, gather_dtype)).bits // 8

    def size(unit, layer: bool):  # gathered bytes, unsharded gradient bytes (the gather dtype's)
        width = [min(p.element_size(), low) if layer else p.element_size() for p in unit]
        return sum(p.numel() * w for p, w in zip(unit, width)), sum(
            p.numel() * (min(4, low) if layer else 4) for p in unit if id(p) in learned_ids
        )

    def whole(models) -> float:  # every unit of ``models`` whole, and the largest's all-gather buffer
        units = []
        for model in models:
            own, rest = fsdp_units(model)
            units += [own] + [unit for unit, _ in rest]
        return sum(_bytes(u) for u in units) + max((_bytes(u) for u in units), default=0)

    if mode != "per_layer":
        parts["weights gathered for a step"] = whole(shardable_models(module)) if sharded else 0.0
        parts["gradients"] = sum(p.numel() * 4 for p in learned)
        return parts, phases | {"weights gathered for a step": STEPS}
    root_bytes = root_grads = 0.0  # the roots stay whole after their forward
    pairs = [(0, 0, 0)]  # (weights, unsharded gradients, the larger's all-gather buffer); one model at a time
    for model in shardable_models(module):
        root, units = fsdp_units(model)
        root_bytes += _bytes(root)
        root_grads += sum(p.numel() * 4 for p in root if id(p) in learned_ids)
        sizes = [size(unit, is_layer) for unit, is_layer in units]
        adjacent = [(a[0] + b[0], a[1] + b[1], max(a[0], b[0])) for a, b in zip(sizes, sizes[1:])]
        pairs += adjacent or [(w, g, w) for w, g in sizes]
    weights, unit_grads, buffer = max(pairs)
    parts["layers gathered in a pass"] = (root_bytes + weights + buffer) if sharded else 0.0
    parts["gradients"] = sum(_local_numel(p) * 4 / shard_over for p in learned) + sharded * (root_grads + unit_grads)
    generated = roots_in(shardable_models(module), generation or [])  # what ``computing`` gathers
    parts["weights gathered for generation"] = whole(generated) if sharded else 0.0
    return parts, phases | {"layers gathered in a pass": (UPDATE,), "weights gathered for generation": GENERATION}


def _world_of(params: list[torch.Tensor], shard_over: int) -> int:
    """The ranks the parameters are (or will be) sharded over."""
    for p in params:
        if hasattr(p, "device_mesh"):
            return p.device_mesh.size()
    return shard_over


def fsdp_units(model: nn.Module) -> tuple[list[torch.Tensor], list[tuple[list[torch.Tensor], bool]]]:
    """The parameters of the FSDP2 units ``per_layer`` makes of ``model``: the root's own (a tied
    embedding, the final norm), then the other units in forward order (an untied embedding, the
    decoder layers, an untied head), each flagged True where it is a decoder layer."""
    layers, edges = unit_modules(model)
    ordered = [(m, False) for m in edges[:1]] + [(m, True) for m in layers] + [(m, False) for m in edges[1:]]
    taken: set[int] = set()
    units = []
    for m, is_layer in ordered:
        own = [p for p in m.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        units.append((own, is_layer))
    return [p for p in model.parameters() if id(p) not in taken], units


def model_names(module: nn.Module) -> dict[int, str]:
    """Each shardable model of ``module`` by its name in it (``agents.0.model``, ``references.0``)."""
    ids = {id(m) for m in shardable_models(module)}
    names: dict[int, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if id(m) in ids:
            names.setdefault(id(m), name)
    return names


def kv_cache_bytes(model: nn.Module, rows: int, tokens: int, dtype: torch.dtype) -> float:
    """The KV cache of ``rows`` sequences of ``tokens`` (keys and values, every layer)."""
    config = causal_lm(model).config
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
    gpu: bool | None = None,
    gather_dtype: str | None = None,
    device: torch.device | None = None,
) -> MemoryPlan:
    """The memory plan of ``module`` (built, sharded where it will be) for a step of ``rollout`` (the
    data module's ``RolloutSettings``; None: no generation planned). The keywords plan ahead for
    other hardware (``scripts/plan_memory.py``): ``shard_over`` ranks of FSDP2 in ``mode`` (gathered
    or per_layer), vLLM's ``gpu_memory_utilization`` and options (``VLLMEngine.options`` of the
    device it will run on), the runtime's bytes, the device's, bf16 autocast, a ``gpu`` (its margins),
    the per-layer ``gather_dtype``, the ``device`` planned for (the module's: not yet moved onto it
    while it is sharded); by default each is read from the run."""
    device = module.device if device is None else device
    gpu = device.type == "cuda" if gpu is None else gpu
    if autocast is None:
        precision = str(module._trainer.precision) if module._trainer is not None else "32-true"
        autocast = precision.startswith("bf16") or module.memory.weights_dtype == "bfloat16"
    dtype = torch.bfloat16 if autocast else None
    if capacity is None:
        trainer = module._trainer
        ranks_here = trainer.num_devices if trainer is not None and device.type == "cpu" else 1
        capacity = device_capacity(device, ranks_here)
    if mode is None:
        mode = module.shards.mode if module.shards is not None else None
    if gather_dtype is None:
        gather_dtype = module.shards.gather_dtype if module.shards is not None else "float32"
    sharded = mode is not None or shard_over > 1
    result = MemoryPlan(device=str(device), capacity=capacity, mode=(mode or "gathered") if sharded else None)
    engine = rollout.engine if rollout is not None else None
    served = engine is not None and engine.own_weights
    generation = [] if served else module.generation_models()
    parts, phases = weight_parts(module, shard_over, mode or "gathered", generation, gather_dtype)
    result.parts["process (runtime, data)"] = (
        process if process is not None else process_overhead(device, parts["weights"])
    )
    result.outside.add("process (runtime, data)")
    if gpu:
        result.parts["CUDA context, NCCL buffers"] = CUDA_CONTEXT + (NCCL_BUFFERS if sharded else 0.0)
        result.outside.add("CUDA context, NCCL buffers")
        result.fragmentation = FRAGMENTATION
    result.parts.update(parts)
    result.phases.update(phases)
    _setup_parts(result, module, sharded, gpu, parts["weights"])
    _gathered_models(result, module, mode if sharded else None, generation)
    result.parts["activations of one update pass"] = update_pass_bytes(module, dtype, result.notes, rollout)
    result.phases["activations of one update pass"] = (UPDATE,)
    agents = list(module.agents) if module.agents is not None else []
    # one engine per model; a team's LoRA adapters on one base share its engine
    models = list(
        {id(m): m for m in (a.model.shared if isinstance(a.model, AdapterView) else a.model for a in agents)}.values()
    )
    if engine is not None and engine.name == "vllm":
        options = vllm_options if vllm_options is not None else engine.options(device.type)
        _vllm_parts(result, options, models, rollout, vllm_share, dtype, gpu, sharded and mode == "per_layer")
    elif engine is not None and engine.name == "vllm_server":
        _sync_stream(result, models, dtype, "weights in flight (server sync)")
        result.notes.append("rollout: generation on the vLLM servers' own GPUs, not the trainer's")
    elif rollout is not None and agents:
        _engine_parts(result, agents, models, engine, rollout, dtype)
    return result


def _engine_parts(result: MemoryPlan, agents: list, models: list, engine, rollout, dtype) -> None:
    """A colocated engine's (lean decoder, transformers') generation memory: its working copy of the
    weights, the rollout's and the evaluation's KV caches, and a cache kept across turns."""
    if engine.name in ("torch", "auto") and (dtype is not None or len(models) > 1):
        # the lean decoder reads each model once per call into its own layout: cast to the autocast
        # dtype, or stacked over the agents (the fp32 head stays the model's)
        copy = sum(p.numel() for m in models for p in m.parameters()) * (2 if dtype is not None else 4)
        result.parts["decoder's working weights"] = float(copy)
        result.phases["decoder's working weights"] = GENERATION
    for phase, evaluation in ((ROLLOUT, False), (EVALUATION, True)):
        rows, length, assumed = rollout.generation_shape(evaluation)
        name = "evaluation KV cache" if evaluation else "generation KV cache"
        # the lean decoder stacks every agent's call of a turn into one: all roles' rows at once
        result.parts[name] = kv_cache_bytes(agents[0].model, rows * len(agents), length, dtype or torch.float32)
        result.phases[name] = (phase,)
        result.notes.append(f"{phase}: {len(agents)} agents x {rows} rows x {length} tokens ({assumed})")
    _kept_cache(result, engine, rollout)


def _kept_cache(result: MemoryPlan, engine, rollout) -> None:
    """The lean engine's KV cache kept between turns: the last turn's, held while the next one generates."""
    if (rollout.episode.max_turns if rollout.episode else rollout.tree.num_turns) > 1 and engine.kept_kv_bytes:
        need = max(result.parts["generation KV cache"], result.parts["evaluation KV cache"])
        result.parts["KV cache kept between turns"] = float(min(engine.kept_kv_bytes, need))
        result.phases["KV cache kept between turns"] = (ROLLOUT, EVALUATION)


def _setup_parts(result: MemoryPlan, module, sharded: bool, gpu: bool, resident: float) -> None:
    """Loading: rank 0 loads every model whole on the host, the other ranks build on the meta device;
    each weight is then broadcast and sharded (one whole weight in flight on the device). On a
    CPU the device is the host: rank 0's setup holds the whole models."""
    if not sharded:
        return
    params = [p for _, p in _unique(module)]
    full, largest = _bytes(params), max((p.numel() * p.element_size() for p in params), default=0)
    process = result.parts["process (runtime, data)"]
    result.parts["a weight in flight (setup)"] = float(largest)
    result.phases["a weight in flight (setup)"] = (SETUP,)
    if not gpu and module.global_rank == 0:  # the other ranks never hold them
        result.parts["whole models on rank 0 (setup)"] = full - resident
        result.phases["whole models on rank 0 (setup)"] = (SETUP,)
    host_others = process + (0.0 if gpu else resident + largest)
    result.host = {"rank 0": process + full, "other ranks": host_others}


def _gathered_models(result: MemoryPlan, module, mode: str | None, generation: list[nn.Module]) -> None:
    """The models each phase holds whole, by name (what ``AgentTeamModule.computing`` gathers)."""
    names = model_names(module)
    every = [names[id(m)] for m in shardable_models(module)]
    if mode is None:  # nothing sharded: every model is whole all along
        result.gathered = {phase: every for phase in PHASES}
        return
    if mode != "per_layer":
        result.gathered = {SETUP: [], **{phase: every for phase in STEPS}}
        return
    generated = sorted(names[id(root)] for root in roots_in(shardable_models(module), generation))
    result.gathered = {SETUP: [], ROLLOUT: generated, EVALUATION: generated, UPDATE: []}


def _vllm_parts(result: MemoryPlan, options: dict, models: list, rollout, share, dtype, gpu: bool, streamed: bool):
    """vLLM's instances: on CPU a fixed KV budget beside their weights; on a GPU the share they are
    given (``share``, else the options'), short where that is less than they need (weights /
    tensor-parallel ranks + the KV cache of the step's generation shape + ~2 GiB). Awake in the
    rollouts and evaluations; with ``enable_sleep_mode`` asleep in the update (what a sleeping
    engine keeps stays). ``streamed``: per-layer FSDP sends each weight gathered as it goes."""
    served = sum(p.numel() for m in models for p in m.parameters()) * (2 if dtype is not None else 4)
    shape = rollout.generation_shape() if models else None
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
            result.short.append(
                f"vLLM needs ~{need / GiB:.1f} GiB (weights / TP, the step's KV cache, ~2 GiB each) but its share is "
                f"{result.parts[name] / GiB:.1f} GiB: raise gpu_memory_utilization in data.engine_options"
            )
    sleeps = bool(options.get("enable_sleep_mode"))
    result.phases[name] = GENERATION if sleeps else STEPS
    result.outside.add(name)  # vLLM's own allocator
    if sleeps and gpu:
        result.parts["vLLM asleep (graphs, pools)"] = VLLM_ASLEEP * len(models)
        result.phases["vLLM asleep (graphs, pools)"] = (UPDATE,)
        result.outside.add("vLLM asleep (graphs, pools)")
    if streamed:
        _sync_stream(result, models, dtype, "weights in flight (vLLM sync)")


def _sync_stream(result: MemoryPlan, models: list, dtype, name: str) -> None:
    """Weights streamed to an engine's own copy, one at a time: the tied embedding made once and the
    current weight, two whole weights at most (the vllm_server engine's only part on the trainer: its
    generation runs on the servers' own GPUs)."""
    if models:
        largest = max(p.numel() for m in models for p in m.parameters()) * (2 if dtype is not None else 4)
        result.parts[name] = 2.0 * largest
        result.phases[name] = GENERATION


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
    # the module is still where it was built (rank 0's host, the others' meta device)
    whole = plan(module, rollout, ranks, capacity=capacity, mode="gathered", device=device)
    over = all_ranks_max(whole.peak - capacity if capacity is not None else -1.0, device)
    mode = "gathered" if over <= 0 else "per_layer"
    rank_zero_info(
        f"FSDP2 mode auto: {mode} (gathered needs {whole.peak / GiB:.2f} GiB of {(capacity or 0) / GiB:.2f})"
    )
    return mode


def check_memory(module, rollout=None) -> MemoryPlan:
    """Print the plan (rank 0) and fail before the first step, naming the settings that shrink the
    largest parts, when its peak exceeds the device."""
    from lightning.pytorch.utilities import rank_zero_info

    result = plan(module, rollout)
    rank_zero_info(result.table())
    if result.short:  # the same on every rank (the options and models are)
        raise ConfigError("; ".join(result.short) + " (model.memory.check: false skips this check)")
    # every rank decides alike (one rank stopping alone would leave the others waiting in a collective)
    over = all_ranks_max(result.peak - result.capacity if result.capacity is not None else -1.0, module.device)
    if over <= 0:
        return result
    fixes = {
        "activations of one update pass": (
            "lower model.memory.forward_token_budget, or model.memory.activation_checkpointing: true"
        ),
        "gradients": "train LoRA adapters (model.lora) or shard over more ranks (TeamFSDPStrategy)",
        "AdamW state": "train LoRA adapters (model.lora) or shard over more ranks (TeamFSDPStrategy)",
        "weights": "set model.memory.weights_dtype: bfloat16, model.lora_shared_base: true, or shard over more ranks",
        "generation KV cache": "lower data.tasks_per_step, data.num_generations or the context",
        "evaluation KV cache": "lower data.eval_tasks_per_step or the context",
        "KV cache kept between turns": "lower kept_kv_gib in data.engine_options (0: re-read every history)",
        "whole models on rank 0 (setup)": "more memory for rank 0, or set model.memory.weights_dtype: bfloat16",
        "vLLM engines (gpu_memory_utilization)": "lower gpu_memory_utilization in data.engine_options",
        "vLLM engines (KV budget, weights)": "lower kv_cache_memory_bytes in data.engine_options",
        "weights gathered for a step": "use per-layer FSDP2 (trainer.strategy.init_args.mode: per_layer)",
        "layers gathered in a pass": "set trainer.strategy.init_args.gather_dtype: bfloat16",
        "weights gathered for generation": "generate with vLLM (data.engine: vllm)",
    }
    held = [name for name in result.held(result.fullest) if name in fixes]
    largest = sorted(held, key=lambda n: -result.parts[n])[:2]
    advice = "; ".join(f"{name} ({result.parts[name] / GiB:.2f} GiB): {fixes[name]}" for name in largest)
    raise ConfigError(
        f"the memory plan needs {result.peak / GiB:.2f} GiB on this rank at its peak (the {result.fullest}; the fullest"
        f" rank {over / GiB:.2f} GiB more than its device), the device has {(result.capacity or 0) / GiB:.2f} GiB. "
        f"Largest: {advice}. (model.memory.check: false skips this check)\n" + result.table()
    )
