"""The trainer's weights to a vLLM server by vLLM's weight transfer protocol (vLLM 0.32,
``--weight-transfer-config``), four phases driven over the server's HTTP routes:

1. once per server: ``/init_weight_transfer_engine {init_info}`` while the trainer opens its end of a
   process group of its own (rank 0; the server's workers, tensor x pipeline x data parallel, are
   ranks 1..W; every worker takes every tensor and keeps its shard of it);
2. per sync: ``/start_weight_update``; ``/update_weights {update_info: names, dtype_names, shapes}`` on a
   thread while the trainer broadcasts each tensor in that order, in the serving dtype, one at a time
   (``weights.effective_weights``: LoRA merged, a sharded weight gathered as it goes); then
   ``/finish_weight_update {weight_version}`` and ``/reset_prefix_cache`` (finishing does not empty it,
   and cached prefixes hold keys and values computed with the old weights).

Transports (``data.engine_options.transport``): ``nccl``, vLLM's own backend for GPUs (the trainer's
rank-0 GPU and the server's GPUs in one NCCL group; vLLM's ``NCCLTrainerWeightTransferEngine`` drives
it, so the trainer's environment needs vLLM), and ``gloo``, this project's backend for CPU servers
(vLLM 0.32 ships none that runs without an accelerator: its NCCL backend fails to initialise on a CPU
build): the same phases and payloads, the tensors broadcast through a gloo group on the hosts
(``vllm_transfer.py`` is its server side, registered as the backend ``lit_marl_gloo`` through the
``vllm.general_plugins`` entry point, so a server finds it wherever lit_marl is installed beside vLLM).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from lit_marl.generation.server_http import ServerClient

GLOO_BACKEND = "lit_marl_gloo"  # the name the server's plugin registers its backend under
TRANSPORTS = ("gloo", "nccl")
Metadata = list[tuple[str, torch.dtype, tuple]]


def gloo_group(store, rank: int, world_size: int, timeout_s: float):
    """A gloo process group of ``world_size`` over ``store``, apart from any ``torch.distributed`` world
    (the trainer's ranks keep theirs; a server's workers keep vLLM's)."""
    return ProcessGroupGloo(PrefixStore("lit_marl_weights", store), rank, world_size, timedelta(seconds=timeout_s))


def update_info(metadata: Metadata) -> dict:
    """The ``update_info`` of one sync: the tensors' names, dtypes and shapes, in the order they are sent."""
    return {
        "names": [name for name, _, _ in metadata],
        "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in metadata],
        "shapes": [list(shape) for _, _, shape in metadata],
    }


def reachable_address(url_host: str) -> str:
    """The trainer's address as the server at ``url_host`` reaches it: loopback for a local server,
    else the address of the interface that routes to it."""
    if url_host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((url_host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


class Sender:
    """The trainer's end of a transport to one server: ``connect`` once (phase 1), ``send`` per sync
    (phases 2-4) the declared ``metadata`` and the tensors in its order, at ``address`` (the trainer's,
    as the server reaches it)."""

    backend: str

    def __init__(self, client: ServerClient, address: str, timeout_s: float):
        self.client, self.address, self.timeout_s = client, address, timeout_s

    def connect(self) -> None:
        raise NotImplementedError

    def send(self, metadata: Metadata, tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        raise NotImplementedError


class GlooSender(Sender):
    """The trainer's end of the ``lit_marl_gloo`` transport to one server."""

    backend = GLOO_BACKEND
    group = store = None

    def connect(self) -> None:
        world = 1 + self.client.world_size()
        timeout = timedelta(seconds=self.timeout_s)
        self.store = TCPStore(self.address, 0, world, True, timeout, wait_for_workers=False)
        info = {"master_address": self.address, "master_port": self.store.port, "rank_offset": 1, "world_size": world}
        with ThreadPoolExecutor(1) as pool:  # the workers block in init until the group forms: both at once
            answer = pool.submit(self.client.post, "/init_weight_transfer_engine", {"init_info": info})
            try:
                self.group = gloo_group(self.store, 0, world, self.timeout_s)
            except RuntimeError as error:
                raise self.client.error(
                    "/init_weight_transfer_engine", f"the workers never joined ({error})"
                ) from error
            answer.result()

    def send(self, metadata: Metadata, tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self.client.post("/start_weight_update")
        pool = ThreadPoolExecutor(1)
        try:
            answer = pool.submit(self.client.post, "/update_weights", {"update_info": update_info(metadata)})
            for (name, dtype, shape), (sent, tensor) in zip(metadata, tensors, strict=True):
                if sent != name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise RuntimeError(f"weight stream out of order: declared {name}, produced {sent}")
                if answer.done():  # refused before the broadcast: its error, not a broadcast's timeout
                    answer.result()
                try:
                    self.group.broadcast([tensor.contiguous()], _root()).wait()
                except RuntimeError as error:
                    raise self.client.error("/update_weights", f"broadcasting {name} failed ({error})") from error
            answer.result()
        finally:
            pool.shutdown(wait=False)  # a worker stuck in a broadcast that never comes must not hang the trainer
        self.client.post("/finish_weight_update", {"weight_version": version})


def _root():
    options = BroadcastOptions()
    options.rootRank = 0
    return options


class NCCLSender(Sender):
    """The trainer's end of vLLM's ``nccl`` transport to one server (GPU): vLLM's own trainer engine,
    driven through this client's routes, reading the stream this sync produces."""

    backend = "nccl"
    engine = source = None

    def connect(self) -> None:
        # deferred: vLLM is optional, and only the nccl transport needs it in the trainer's environment
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        world = 1 + self.client.world_size()
        self.phases = _Phases(self.client)
        self.source = _stream_source()
        info = NCCLTrainerInitInfo(master_address=self.address, master_port=free_port(), world_size=world, rank=0)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.phases, source=self.source)

    def send(self, metadata: Metadata, tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        self.source.load(metadata, tensors)
        self.phases.version = version
        self.engine.send_weights()


class _Phases:
    """vLLM's ``VLLMWeightSyncClient`` over a ``ServerClient`` (its finish carries this sync's version)."""

    def __init__(self, client: ServerClient):
        self.client, self.version = client, None

    def init_weight_transfer_engine(self, init_info):
        self.client.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self.client.post("/start_weight_update")

    def update_weights(self, update_info):
        self.client.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.client.post("/finish_weight_update", {"weight_version": weight_version or self.version})


def _stream_source():
    """vLLM's ``WeightSource`` over one sync's declared metadata and its tensor stream (``load``)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource  # deferred: vLLM is optional

    class Stream(WeightSource):
        def load(self, metadata: Metadata, tensors):
            self.declared, self.tensors = metadata, tensors

        def metadata(self):
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in self.declared]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.tensors)

    return Stream()


def make_sender(transport: str, client: ServerClient, address: str, timeout_s: float) -> Sender:
    return (GlooSender if transport == "gloo" else NCCLSender)(client, address, timeout_s)
