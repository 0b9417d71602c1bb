"""FSDP2 (``fully_shard``) for an agent team: weights, gradients and optimizer states sharded
across ranks, with collectives only at points every rank reaches the same number of times.

An RL step does not fit FSDP's usual rhythm of one forward and one backward per rank: ``generate``
runs one forward per new token (sequence lengths differ per rank), and an update runs as many
passes as the rank's trees have rows (early termination makes them differ). Every FSDP forward
and backward is a collective (all-gather of a layer's weights, reduce-scatter of its gradients),
so those counts would have to match exactly or the ranks deadlock. Instead:

- ``gathered()`` all-gathers each model's weights once (the rollout of a step, an update) and keeps
  them while the rank runs any number of forwards and backwards without communication
  (gradients accumulate unsharded, as FSDP's own gradient accumulation does);
- ``reduce_gradients`` ends every optimizer step with one zero-loss pass per model with gradient
  sync on: FSDP reduce-scatters the accumulated gradients of all ranks (a sum: our losses are
  already divided by the count over all ranks) into each rank's shard;
- ``refresh`` re-gathers a model after its optimizer stepped its shards.

Optimizer steps are already the same on every rank (``parallel.collectives.padded_steps``), so
these are the only collectives, and they match. Between steps each rank holds 1/world of the
weights and of AdamW's state; during a step, the full weights and gradients of the models in use
(generation needs the full weights anyway).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_marl import ConfigError


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
    """The sharded models of a team and the collectives around their use (see the module doc)."""

    def __init__(self, models: list[nn.Module], mesh):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.mesh = mesh
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
        self.roots: list[nn.Module] = []
        self.params_of: list[set[int]] = []  # ids of each root's sharded parameters (what optimizers hold)
        for model in models:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            blocks = set(getattr(base, "_no_split_modules", None) or ())
            for layer in [m for m in model.modules() if type(m).__name__ in blocks]:
                fully_shard(layer, mesh=mesh)  # one all-gather unit per decoder layer
            fully_shard(model, mesh=mesh)
            model.set_requires_gradient_sync(False)  # gradients are reduced by ``reduce_gradients`` only
            model.set_reshard_after_backward(False)
            # every trainable parameter takes part in every reduction (zero where unused), so the
            # reduce-scatter has the same layout on every rank whatever each rank's passes touched
            model.set_reduce_scatter_unused_params(True)
            for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
                unit.set_gradient_divide_factor(1.0)  # a sum over ranks
                unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
            self.roots.append(model)
            self.params_of.append({id(p) for p in model.parameters()})
        self.depth = 0

    def units(self, roots: list[nn.Module] | None = None) -> Iterator[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        for root in self.roots if roots is None else roots:
            yield from (m for m in root.modules() if isinstance(m, FSDPModule))

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Full weights on every rank inside; re-entrant (only the outermost level communicates)."""
        if self.depth == 0:
            self._unshard(self.roots)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for unit in self.units():
                    unit.reshard()
                    unit.set_reshard_after_forward(True, recurse=False)

    def _unshard(self, roots: list[nn.Module]) -> None:
        for unit in self.units(roots):
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()

    def roots_of(self, params: list[torch.Tensor]) -> list[nn.Module]:
        ids = {id(p) for p in params}
        return [root for root, own in zip(self.roots, self.params_of) if own & ids]

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Sum the gradients accumulated on every rank into each rank's shards of ``params``: one
        zero-loss forward/backward per model holding any of them, with gradient sync on."""
        if self.depth == 0:
            raise RuntimeError("TeamShards.reduce_gradients outside gathered(): the passes would have communicated")
        for root in self.roots_of(params):
            root.set_requires_gradient_sync(True)
            # weights stored in several dtypes (model.weights_dtype) compute only under autocast
            low = {p.dtype for p in root.parameters()} - {torch.float32}
            autocast = torch.autocast(self.device.type, dtype=min(low, key=str) if low else None, enabled=bool(low))
            try:
                with autocast:
                    out = root(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
                (out[0].float().sum() * 0).backward()
            finally:
                root.set_requires_gradient_sync(False)

    def refresh(self, params: list[torch.Tensor]) -> None:
        """After an optimizer step on the shards of ``params``: gather those models' new weights."""
        roots = self.roots_of(params)
        for unit in self.units(roots):
            unit.reshard()
        if self.depth > 0:
            self._unshard(roots)

    def full_copy(self, model: nn.Module) -> nn.Module | None:
        """A plain (unsharded, unwrapped) copy of ``model`` on rank 0, None on the other ranks; every
        rank must call it (it gathers the shards)."""
        from peft import get_peft_model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from transformers import AutoModelForCausalLM

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        if torch.distributed.get_rank() != 0:
            return None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        plain = AutoModelForCausalLM.from_config(base.config).to(next(iter(state.values())).dtype)
        if hasattr(model, "peft_config"):
            plain = get_peft_model(plain, model.peft_config[model.active_adapter])
        plain.load_state_dict(state)
        return plain

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


def check_shardable(module: nn.Module) -> None:
    """What FSDP here cannot do yet, refused before any weights move."""
    if getattr(module, "lora_shared_base", False):
        raise ConfigError(
            "model.lora_shared_base=true with FSDP: the agents' adapters share one sharded base and their "
            "gradients would be reduced together; use model.lora_shared_base: false (one model per agent) or "
            "trainer.strategy: lit_marl.parallel.strategies.TeamDDPStrategy"
        )
