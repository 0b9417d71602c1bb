"""The server side of the ``lit_marl_gloo`` weight transfer backend (``transfer.py``): vLLM 0.32's
four-phase protocol over a gloo group on the hosts, for vLLM's CPU build, which has no backend of its
own that runs without an accelerator. ``register`` is a ``vllm.general_plugins`` entry point
(pyproject.toml): every vLLM process where lit_marl is installed knows the backend's name, and a
server started with ``--weight-transfer-config '{"backend": "lit_marl_gloo"}'`` builds it; this module
is imported only there (it needs vLLM).

Each worker joins the trainer's group at rank ``data_parallel_index x world_size + rank + rank_offset``
(vLLM's NCCL backend's numbering), receives every tensor of ``update_info`` in order and loads it
through vLLM's layerwise reload (``start_weight_update`` / ``finish_weight_update``), which repacks
what the CPU kernels keep in their own layout, and shards what tensor parallelism splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from lit_marl.generation.transfer import GLOO_BACKEND, gloo_group

TIMEOUT_S = 600.0  # a broadcast that waits longer: the trainer is gone


def register() -> None:
    """Name the backend in vLLM's factory (plugins load once per vLLM process; registering twice raises)."""
    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, __name__, "GlooWeightTransferEngine")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("update_info: names, dtype_names and shapes must have one entry per tensor")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        self.store = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        timeout = timedelta(seconds=TIMEOUT_S)
        self.store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False, timeout)
        self.group = gloo_group(self.store, rank, init_info.world_size, TIMEOUT_S)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU build; a gloo
        # broadcast has completed when its wait() returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        self.group = None
        self.store = None
