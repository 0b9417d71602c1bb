"""Every collective a process issues through ``torch.distributed``, in order, as (name, numel of its
first tensor): two ranks that issue the same sequence cannot deadlock on each other, and a rank
whose sequence differs would have (a test compares the ranks' traces).

    with CollectiveTrace() as trace:
        ...
    trace.calls  # [("all_gather_single", 4096), ("reduce_scatter_single", 8192), ...]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAMES = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
    "all_gather_object",
    "broadcast_object_list",
    "reduce_scatter",
    "barrier",
)
FUNCTIONAL = (
    "all_gather_single",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
)


def _numel(args, kwargs) -> int:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return sum(t.numel() for t in value)
    return 0


class CollectiveTrace:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveTrace":
        import torch.distributed._functional_collectives as funcol  # DTensor's (full_tensor, redistribute)

        for module, names, prefix in ((dist, NAMES, ""), (funcol, FUNCTIONAL, "functional.")):
            for name in names:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._saved[module, name] = original

                def traced(*args, _name=prefix + name, _original=original, **kwargs):
                    self.calls.append((_name, _numel(args, kwargs)))
                    return _original(*args, **kwargs)

                setattr(module, name, traced)
        return self

    def __exit__(self, *exc) -> None:
        for (module, name), original in self._saved.items():
            setattr(module, name, original)
