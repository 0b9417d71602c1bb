"""FSDP2 (``fully_shard``) for an agent team, in two modes, with the same collectives on every rank.

An RL step does not fit FSDP's usual rhythm of one forward and one backward per rank: ``generate``
runs one forward per new token (sequence lengths differ per rank), and an update runs as many
passes as the rank's rows need (early termination, different episode lengths). Every FSDP forward
and backward is a collective (all-gather of a unit's weights, reduce-scatter of its gradients), so
the passes must match across ranks or the ranks deadlock. Two ways to make them match:

``gathered`` (for models that fit whole on a device; cheapest traffic)
    ``gathered()`` all-gathers each model once (the rollout of a step, an update) and keeps it
    while the rank runs any number of forwards and backwards without communication (gradients
    accumulate unsharded); ``reduce_gradients`` ends every optimizer step with one zero-loss pass
    per model with gradient sync on (FSDP reduce-scatters the accumulated gradients into each
    rank's shard); ``refresh`` re-gathers a model after its optimizer stepped.

``per_layer`` (FSDP's own memory: 7B and up)
    each decoder layer is its own unit, gathered only while it computes and resharded after its
    forward; untied embeddings and LM heads are units of their own; gradients are reduce-scattered
    in every backward and the optimizer steps the shards. Every loop of passes over a rank's rows
    runs through ``lockstep``: the all-rank maximum of the loop's pass count is agreed first, and a
    rank with fewer passes runs zero-loss 1-token passes of the same models until it reaches it, so
    every rank issues the same collectives in the same order. Generation and evaluation gather the
    models they generate with around the rollout (``gathered()``), as TRL's
    ``ds3_gather_for_generation`` does, none when vLLM generates (it holds its own copy);
    references and critics are scored in lockstep passes. One pass is one forward of each model it uses
    (``lockstep`` checks it): the shared-prompt pass, two forwards of a model, is not used.

Optimizer steps are already the same on every rank (``parallel.collectives.padded_steps``).
Between steps each rank holds 1/world of the weights and of AdamW's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from lit_marl import ConfigError
from lit_marl.models import causal_lm
from lit_marl.parallel.collectives import all_ranks_max

MODES = ("gathered", "per_layer", "auto")


def shardable_models(module: nn.Module) -> list[nn.Module]:
    """The outermost HF (or peft) models inside ``module``, each once (a shared model is listed once)."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    found: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> None:
        if isinstance(m, (PreTrainedModel, PeftModel)):
            found.setdefault(id(m), m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return list(found.values())


class TeamShards:
    """The sharded models of a team and the collectives around their use (see the module doc).
    ``gather_dtype`` (per_layer only): the dtype decoder layers are gathered and compute in
    (bfloat16 halves their traffic; gradients are still reduced in fp32; embeddings and heads fp32)."""

    def __init__(self, models: list[nn.Module], mesh, mode: str = "gathered", gather_dtype: str = "float32"):
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if mode not in ("gathered", "per_layer"):
            raise ValueError(f"TeamShards: mode must be gathered or per_layer, got {mode!r}")
        self.mesh, self.mode, self.gather_dtype = mesh, mode, gather_dtype
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
        per_layer = mode == "per_layer"
        if gather_dtype != "float32" and not per_layer:
            raise ConfigError(
                f"gather_dtype={gather_dtype} with mode={mode}: whole gathered models accumulate their gradients "
                "unsharded, in the gathered dtype; use mode: per_layer, or gather_dtype: float32"
            )
        low = gather_dtype != "float32"  # else each parameter is gathered and computes in its stored dtype
        layer_policy = (
            MixedPrecisionPolicy(param_dtype=getattr(torch, gather_dtype), reduce_dtype=torch.float32)
            if low
            else MixedPrecisionPolicy()
        )
        self.roots: list[nn.Module] = []
        self.params_of: list[set[int]] = []  # ids of each root's sharded parameters (what optimizers hold)
        for model in models:
            layers, edges = unit_modules(model)
            for layer in layers:  # one all-gather unit per decoder layer
                fully_shard(layer, mesh=mesh, mp_policy=layer_policy)
            for edge in edges if per_layer else ():  # torchtitan's embedding and output units
                fully_shard(edge, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh)
            if not per_layer:
                model.set_requires_gradient_sync(False)  # gradients are reduced by ``reduce_gradients`` only
                model.set_reshard_after_backward(False)
            # every trainable parameter takes part in every reduction (zero where unused), so the
            # reduce-scatter has the same layout on every rank whatever each rank's passes touched
            model.set_reduce_scatter_unused_params(True)
            for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
                unit.set_gradient_divide_factor(1.0)  # a sum over ranks
                unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
            model.register_forward_pre_hook(self._record)
            self.roots.append(model)
            self.params_of.append({id(p) for p in model.parameters()})
        self.depth = 0
        self.held: list[nn.Module] = []  # the roots ``gathered()`` holds whole
        self.stepped: set[int] = set()  # roots whose shards an optimizer stepped since their last gather
        self._seen: list[int] | None = None  # inside a lockstep pass: the roots forwarded, in order

    def _record(self, root: nn.Module, _args) -> None:
        if self._seen is not None:
            self._seen.append(id(root))

    def units(self, roots: list[nn.Module] | None = None) -> Iterator[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        for root in self.roots if roots is None else roots:
            yield from (m for m in root.modules() if isinstance(m, FSDPModule))

    @contextmanager
    def gathered(self, roots: list[nn.Module] | None = None) -> Iterator[None]:
        """Full weights of ``roots`` (default: every model) on every rank inside; re-entrant (only
        the outermost level communicates). No backward may run inside in ``per_layer`` mode (its
        gradients reduce in every backward)."""
        if self.depth == 0:
            self.held = list(self.roots if roots is None else roots)
            self._unshard(self.held)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._reshard(self.held)
                self.held = []

    @contextmanager
    def updating(self) -> Iterator[None]:
        """The block of an update: ``gathered()`` in that mode; per_layer gathers layer by layer."""
        if self.mode == "gathered":
            with self.gathered():
                yield
        else:
            yield

    def _unshard(self, roots: list[nn.Module]) -> None:
        for unit in self.units(roots):
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        # FSDP2 gathers into the same parameter objects without bumping their versions: where the
        # shards changed since the last gather, mark the gathered weights changed, so whoever compares
        # versions (an engine that holds its own copy) sees new weights, and only then
        for root in (r for r in roots if id(r) in self.stepped):
            for p in root.parameters():
                torch.autograd.graph.increment_version(p)
        self.stepped -= {id(r) for r in roots}

    def _reshard(self, roots: list[nn.Module]) -> None:
        for unit in self.units(roots):
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)

    def roots_of(self, params: Iterable[torch.Tensor]) -> list[nn.Module]:
        ids = {id(p) for p in params}
        return [root for root, own in zip(self.roots, self.params_of) if own & ids]

    def roots_in(self, models: Iterable[nn.Module]) -> list[nn.Module]:
        """The sharded roots ``models`` forward, in their order (``roots_in``)."""
        return roots_in(self.roots, models)

    def lockstep(self, chunks: list, models: Iterable[nn.Module], backward: bool = False) -> Iterator:
        """The passes of one loop over this rank's ``chunks`` (each pass forwards every model of
        ``models`` once, in that order, and with ``backward`` runs one backward), then, under
        ``per_layer``, zero-loss 1-token passes of the same models up to the most any rank runs:
        every rank then issues the same all-gathers and reduce-scatters. Every rank must call it
        for the same loops in the same order."""
        roots = self.roots_in(models)
        if self.mode != "per_layer" or all(any(r is h for h in self.held) for r in roots):
            yield from chunks  # whole weights held: the passes do not communicate
            return
        total = int(all_ranks_max(len(chunks), self.device))
        for chunk in chunks:
            self._seen = []
            try:
                yield chunk
            finally:
                seen, self._seen = self._seen, None
            if seen and seen != [id(r) for r in roots]:
                names = [type(r).__name__ for r in self.roots if id(r) in seen]
                raise RuntimeError(
                    f"TeamShards.lockstep: a pass forwarded {names} where its loop declared "
                    f"{[type(r).__name__ for r in roots]}; the padding passes of other ranks would not match"
                )
        for _ in range(total - len(chunks)):
            self.padding_pass(roots, backward)

    def padding_pass(self, roots: list[nn.Module], backward: bool) -> None:
        """One forward of each root on a 1-token row, and with ``backward`` one backward of a zero
        loss over them: the collectives of a real pass, no gradient."""
        with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
            zero = None
            for root in roots:
                with self._autocast(root):
                    out = root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
                term = out[0].float().sum() * 0
                if term.requires_grad:
                    zero = term if zero is None else zero + term
            if zero is not None:
                zero.backward()

    def _autocast(self, root: nn.Module):
        # weights stored in several dtypes (model.memory.weights_dtype) compute only under autocast
        low = {p.dtype for p in root.parameters()} - {torch.float32}
        return torch.autocast(self.device.type, dtype=min(low, key=str), cache_enabled=False) if low else nullcontext()

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients accumulated on every rank into each rank's shards of ``params``: one
        zero-loss forward/backward per model holding any of them, with gradient sync on. Nothing
        under ``per_layer``: each backward reduced its gradients already."""
        if self.mode == "per_layer":
            return
        if self.depth == 0:
            raise RuntimeError("TeamShards.reduce_gradients outside gathered(): the passes would have communicated")
        for root in self.roots_of(params):
            root.set_requires_gradient_sync(True)
            try:
                with self._autocast(root):
                    out = root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
                (out[0].float().sum() * 0).backward()
            finally:
                root.set_requires_gradient_sync(False)

    def refresh(self, params: list[torch.Tensor]) -> None:
        """After an optimizer step on the shards of ``params`` (every step, in both modes): those models'
        shards changed; inside ``gathered()`` their new weights are gathered at once."""
        stepped = self.roots_of(params)
        self.stepped |= {id(root) for root in stepped}
        roots = [root for root in stepped if any(root is h for h in self.held)]
        for unit in self.units(roots):
            unit.reshard()
        self._unshard(roots)

    def full_copy(self, model: nn.Module) -> nn.Module | None:
        """A plain (unsharded, unwrapped) copy of ``model`` on rank 0, None on the other ranks; every
        rank must call it (it gathers the shards). Rank 0 holds the model once: the gathered state
        (in CPU memory) becomes the copy's parameters, built on the meta device and assigned."""
        from peft import get_peft_model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForCausalLM

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if torch.distributed.get_rank() != 0:
            return None
        base = causal_lm(model)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(base.config, dtype=next(iter(state.values())).dtype)
            if hasattr(model, "peft_config"):
                plain = get_peft_model(plain, model.peft_config[model.active_adapter])
        plain.load_state_dict(state, assign=True)
        sources = dict(model.named_modules())
        for name, module in plain.named_modules():  # buffers outside the state (rotary frequencies)
            for key in module._non_persistent_buffers_set:
                module._buffers[key] = sources[name]._buffers[key].detach().cpu().clone()
        plain.tie_weights()
        return plain.eval()

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_`` over sharded and replicated gradients: the squared
        norm of the shards is summed over ranks, replicated gradients (already summed) count once."""
        from torch.distributed.tensor import DTensor

        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            if isinstance(g, DTensor):
                sharded += g.to_local().double().pow(2).sum().cpu()
            else:
                replicated += g.double().pow(2).sum().cpu()
        sharded = sharded.to(self.device)
        torch.distributed.all_reduce(sharded, group=self.mesh.get_group())
        norm = float((sharded.cpu() + replicated).sqrt())
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm


def roots_in(roots: list[nn.Module], models: Iterable[nn.Module]) -> list[nn.Module]:
    """The roots (shardable models) ``models`` forward, in their order: a root, a module inside one
    (a peft model's base) or a module holding one (a reward model around its backbone)."""
    out = []
    for model in models:
        inner = {id(m) for m in model.modules()}
        out += [r for r in roots if id(r) in inner or any(m is model for m in r.modules())][:1]
    return out


def load_from_rank0(module: nn.Module, models: list[nn.Module], loaded: list[dict], device: torch.device) -> None:
    """After ``TeamShards`` sharded ``models`` (rank 0: its loaded weights; the other ranks: empty, on
    the meta device), fill every rank's shards from rank 0's ``loaded`` state dicts (empty elsewhere),
    one tensor broadcast at a time, as verl's ``fsdp2_load_full_state_dict``; then every other
    parameter and buffer of ``module`` (value heads, rotary frequencies) from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    if torch.distributed.get_rank() != 0:
        module.to_empty(device=device)  # storage for the shards, the replicated weights, the buffers
    module.to(device)  # rank 0's; on every rank, Lightning's record of the module's device too
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for model, state in zip(models, loaded):
        set_model_state_dict(model, state, options=options)
    for tensor in [*module.parameters(), *module.buffers()]:
        if not isinstance(tensor, DTensor):
            torch.distributed.broadcast(tensor.data, src=0)


def unit_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules below ``model`` that become FSDP2 units: its decoder layers (the model's
    ``_no_split_modules``), and its untied embedding and head (their own units under ``per_layer``);
    the rest stays in the root unit."""
    base = causal_lm(model)
    blocks = set(getattr(base, "_no_split_modules", None) or ())
    # by class name, also once sharded (fully_shard makes each unit an ``FSDP<Layer>`` subclass)
    layers = [m for m in model.modules() if any(c.__name__ in blocks for c in type(m).__mro__)]
    return layers, untied_edges(base)


def untied_edges(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output head of ``model`` when they hold separate weights (a
    tied pair stays in the root unit: one tensor cannot sit in two units)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is None or head is None or head.weight is embed.weight:
        return [m for m in (embed,) if m is not None and head is None]
    return [embed, head]


def check_shardable(module: nn.Module, mesh=None) -> None:
    """What FSDP here cannot do yet, refused before any weights move."""
    if mesh is not None and mesh["tensor_parallel"].size() > 1:  # Lightning's mesh: (data_parallel, tensor_parallel)
        raise ConfigError(
            f"trainer.strategy: tensor_parallel_size={mesh['tensor_parallel'].size()}; lit_marl shards agents "
            "with FSDP over data-parallel ranks only: use lit_marl.parallel.strategies.TeamFSDPStrategy (or "
            "ModelParallelStrategy with tensor_parallel_size: 1 and data_parallel_size: the number of ranks)"
        )
    if getattr(module, "lora_shared_base", False):
        raise ConfigError(
            "model.lora_shared_base=true with FSDP: the agents' adapters share one sharded base and their "
            "gradients would be reduced together; use model.lora_shared_base: false (one model per agent) or "
            "trainer.strategy: lit_marl.parallel.strategies.TeamDDPStrategy"
        )
