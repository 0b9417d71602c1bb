"""Cross-rank collectives as free functions. Each is the identity in one process, so every caller
reads the same on one rank and on many: a sum, max or statistic over every rank's rows.

The team's modules are not wrapped in DistributedDataParallel (``parallel/strategies.py``): the
gradients of an optimizer's parameters are summed here, in one flat all-reduce per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if world_size() > 1 else 0


def barrier() -> None:
    """Every rank waits for the others (nothing in one process)."""
    if world_size() > 1:
        dist.barrier()


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (``obj`` itself in one process)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks_sum(value: float, device: torch.device) -> float:
    return _all_ranks(value, dist.ReduceOp.SUM, device)


def all_ranks_max(value: float, device: torch.device) -> float:
    return _all_ranks(value, dist.ReduceOp.MAX, device)


def _all_ranks(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    if world_size() == 1:
        return value
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return float(tensor)


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if world_size() == 1:
        return [obj]
    gathered = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def padded_steps(batches: list, device: torch.device, groups: list[int] | None = None) -> list:
    """The mini-batches of this rank, padded with ``None`` to the most any rank has: trees end
    early on some ranks, yet every rank must take every optimizer step (and join its gradient sum).

    ``groups`` (one non-decreasing id per batch, e.g. its turn) keeps groups aligned across ranks:
    each group is padded to the most batches any rank has in it, so step k holds the same group on
    every rank (a rank whose trees ended before a turn joins that turn's steps with ``None``)."""
    if groups is None:
        return batches + [None] * (int(all_ranks_max(len(batches), device)) - len(batches))
    if list(groups) != sorted(groups) or len(groups) != len(batches):
        raise ValueError("padded_steps: groups must give one non-decreasing id per batch")
    out = []
    for group in range(int(all_ranks_max(max(groups, default=-1) + 1, device))):
        mine = [b for b, g in zip(batches, groups) if g == group]
        out += mine + [None] * (int(all_ranks_max(len(mine), device)) - len(mine))
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / std over the entries where ``mask`` is set on every rank (unbiased std,
    as ``torch.std``); 0 elsewhere. Unchanged when there are fewer than two such entries."""
    device = values.device
    chosen = values[mask.bool()].double()
    count = all_ranks_sum(chosen.numel(), device)
    if count < 2:
        return values
    total, squares = all_ranks_sum(float(chosen.sum()), device), all_ranks_sum(float((chosen**2).sum()), device)
    mean = total / count
    std = max((squares - count * mean**2) / (count - 1), 0.0) ** 0.5
    return (values - mean) / (std + 1e-6) * mask


def z_score_per_group(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std within each group id (e.g. a turn), the moments taken over the rows of every
    rank (one process with all the rows gives the same result); the population std, floored at
    1e-6 (CoMLRL's form). A group of one row keeps its value: there is nothing to compare it with,
    and centring it would silence it (an actor with one episode per update would never move)."""
    device = values.device
    num_groups = int(all_ranks_max(int(groups.max()) + 1, device))
    moments = torch.zeros(3, num_groups, dtype=torch.float64, device=device)
    moments[0].index_add_(0, groups, torch.ones_like(values, dtype=torch.float64))
    moments[1].index_add_(0, groups, values.double())
    moments[2].index_add_(0, groups, values.double() ** 2)
    if world_size() > 1:
        dist.all_reduce(moments)
    count = moments[0].clamp(min=1)
    mean = moments[1] / count
    var = (moments[2] / count - mean**2).clamp(min=0)
    scored = (values - mean[groups]) / var[groups].sqrt().clamp(min=1e-6)
    return torch.where(moments[0][groups] > 1, scored, values.double()).float()


def sum_gradients(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """Sum the gradients of ``params`` over ranks in one flat all-reduce. Sharded parameters (FSDP
    DTensors) are left out: their gradients were reduced into the shards already."""
    if world_size() == 1:
        return
    params = [p for p in params if not isinstance(p, DTensor)]
    # a parameter without a gradient on every rank keeps none, as in one process (AdamW then
    # skips it: a zero gradient would still count a step and move it by its momentum)
    has_grad = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
    params = [p for p, flag in zip(params, has_grad.tolist()) if flag]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(p).clone()
        offset += g.numel()


def to_cpu(tree):
    """Tensors of a nested dict/list moved to the CPU (another rank's may be on its own GPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_cpu(v) for v in tree]
    return tree
