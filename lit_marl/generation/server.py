"""Rollouts on vLLM servers (``data.engine: vllm_server``): generation on GPUs (or nodes) of their own,
with tensor and data parallelism, the trainer's weights sent by vLLM's weight transfer protocol.

One server per distinct model of the team: started by the run on this machine (``server_process.py``;
``tensor_parallel_size``, ``data_parallel_size``, ``gpus``), or running already (``servers``: their
addresses, in the order the team's models first appear; each started with ``VLLM_SERVER_DEV_MODE=1``,
``--tokens-only``, ``--generation-config vllm`` and ``--weight-transfer-config`` naming the transport's
backend). A team of LoRA adapters on one base (``model.lora_shared_base``) is one server: the base sent
by the transfer protocol once (it is frozen), each agent's adapter saved (peft's format) and loaded by
path through vLLM's runtime LoRA route after each update that changed it (``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), each request naming its agent's adapter.

Every prompt of a call is its own request, all in flight at once (up to ``max_concurrency``
per engine): the server batches them. A request is token ids in, token ids and each sampled token's
log-prob out (vLLM's raw distribution, what the trainer's forward recomputes), every sampling field sent
(vLLM's defaults never apply) with a seed drawn from the run's generator, so a seeded run samples the
same rollouts again (each rank its own streams); seeds handed in (``generate_team``'s, one per prompt:
``data.sampling_streams: per_task``, ``data.turns: independent``) are the requests' own, so a response does
not depend on the order requests arrive in (vLLM samples a seeded request from a generator of its own), up
to the float differences a batch's other rows make in its logits.

At the start of each rollout block (``rollout``; a generation outside one only sends a model never
sent) every model whose parameters changed since its last sync is sent whole
(``transfer.py``: vLLM's four phases, its version the sync's count) and its server's prefix cache
emptied; under several trainer ranks every rank takes part in the gathers of a sharded model, rank 0
starts the servers and sends, and no rank generates before the sync has finished. A server that dies,
refuses or does not answer within ``timeout_s`` raises ``ServerError`` naming it (a server the run
started: its exit code and the end of its log), which stops the run before the step's update, with the
last checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.fields import PositiveFloat, PositiveInt, check_dataclass
from lit_marl.generation.base import Generation, Sampling, stream_seed
from lit_marl.generation.server_http import ServerClient, ServerError
from lit_marl.generation.server_process import ServerProcess, start_server
from lit_marl.generation.transfer import GLOO_BACKEND, free_port, make_sender, reachable_address
from lit_marl.generation.vllm import (
    Sample,
    adapter_version,
    base_alone,
    base_version,
    check_serving_dtype,
    compute_dtype,
    each_served,
    generation_of,
    lora_slots,
    request_adapter,
    sampling_params,
    served,
    served_adapters,
)
from lit_marl.generation.weights import effective_weights, served_metadata
from lit_marl.parallel.collectives import barrier, from_rank0, rank

SERVED_NAME = "lit_marl"  # the model name a started server answers to


@dataclass(frozen=True)
class ServerSettings:
    """``data.engine_options`` of ``engine: vllm_server``."""

    servers: list[str] | None = None
    """Running servers' addresses (http://host:port), one per distinct model of the team; null: the run starts them."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs (CPU: processes) each started server splits its model over."""
    data_parallel_size: PositiveInt = 1
    """Replicas in each started server (vLLM balances requests over them)."""
    gpus: str | None = None
    """CUDA_VISIBLE_DEVICES of started servers (e.g. "4,5,6,7": GPUs the trainer does not use); null: inherited."""
    transport: Literal["auto", "nccl", "gloo"] = "auto"
    """How weights travel: nccl (vLLM's, GPU), gloo (CPU: lit_marl's backend in the server); auto: by device."""
    timeout_s: PositiveFloat = 600.0
    """Seconds a request or a weight transfer may take before the run stops with an error naming the server."""
    start_timeout_s: PositiveFloat = 1200.0
    """Seconds a started server may take to answer its health check."""
    max_concurrency: PositiveInt = 256
    """Requests in flight at once (every prompt of a call is one)."""
    server_args: dict = field(default_factory=dict)
    """More flags of started servers, e.g. {max_model_len: 8192, gpu_memory_utilization: 0.9}."""
    python: str | None = None
    """The interpreter that starts servers (one with vLLM installed); null: this one."""
    host: str = "127.0.0.1"
    """The address started servers listen on."""
    log_dir: str | None = None
    """Where started servers write their logs (vllm_server_<port>.log); null: <temp dir>/lit_marl_server_logs."""
    adapter_dir: str | None = None
    """Where a LoRA team's adapters are saved for the servers to load by path (servers on other nodes: a
    shared file system); null: a temporary folder on this machine."""

    def __post_init__(self):
        check_dataclass("data.engine_options", self)
        if self.servers is not None and (not self.servers or any(not str(s).startswith("http") for s in self.servers)):
            raise ConfigError(f"data.engine_options.servers={self.servers!r}: give http://host:port addresses, or null")


def server_settings(options: dict) -> ServerSettings:
    known = {f.name for f in fields(ServerSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"data.engine_options: {unknown} unknown to the vllm_server engine (it takes {sorted(known)})")
    return ServerSettings(**options)


class _Server:
    """One model's server as the engine uses it: its client, its transfer sender (rank 0), the process the
    run started (if any), the dtype it serves and the version of the weights it holds."""

    def __init__(self, client: ServerClient, process: ServerProcess | None, dtype: str):
        self.client, self.process, self.dtype = client, process, dtype
        self.sender = None
        self.version = None
        self.adapters: dict[str, tuple] = {}  # a LoRA team's adapter -> (the version loaded, its folder)


class VLLMServerEngine:
    name = "vllm_server"
    own_weights = True
    remote = True
    kept_kv_bytes = 0

    def __init__(self, **options):
        self.settings = server_settings(options)
        self.servers: dict[int, _Server] = {}  # id(model) -> its server
        self.syncs = 0  # weight transfers so far (all models)
        self.pool = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="lit_marl_requests")
        self.seeds: torch.Generator | None = None  # the requests' seeds, drawn from the run's at each rollout
        self.lock = threading.Lock()  # episodes playing their own turns call generate from threads of their own
        self.adapter_syncs = 0  # adapters saved and loaded so far (LoRA teams on one base)
        self.folder: tempfile.TemporaryDirectory | None = None  # their saved versions (no adapter_dir)

    def check_team(self, agents: list[Agent], device_type: str) -> None:
        """Before step 1: one address per distinct model (a LoRA team on one base is one), and vLLM's NCCL
        engine where the transport is nccl."""
        models = each_served(agents, per_adapter=False)
        for agent in models:
            if adapters := served_adapters(agent):
                lora_slots(adapters)  # a rank vLLM cannot serve is named now
        if self.transport(device_type) == "nccl" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(
                "data.engine_options.transport=nccl drives vLLM's NCCL transfer from the trainer, and vllm is not "
                "installed here: install the vLLM build the servers run beside lit_marl, or use transport: gloo"
            )
        if self.settings.servers is not None and len(self.settings.servers) != len(models):
            raise ConfigError(
                f"data.engine_options.servers lists {len(self.settings.servers)} addresses for {len(models)} distinct "
                f"models of the team ({[a.source for a in models]}): give one per model, in the team's order"
            )

    def transport(self, device_type: str) -> str:
        if self.settings.transport != "auto":
            return self.settings.transport
        return "nccl" if device_type == "cuda" else "gloo"

    def server(self, agent: Agent) -> _Server:
        """The server of ``agent``'s model (a LoRA team's: its base), started or reached the first time it is
        asked for."""
        model = served(agent)[0]
        key = id(model)
        if key in self.servers:
            return self.servers[key]
        device = next(model.parameters()).device
        dtype = compute_dtype(device.type)
        index = len(self.servers)
        process = None
        if rank() == 0:
            if self.settings.servers is not None:
                url = self.settings.servers[index]
            else:
                backend = GLOO_BACKEND if self.transport(device.type) == "gloo" else "nccl"
                adapters = served_adapters(agent)
                lora = lora_slots(adapters) if adapters else None
                process = start_server(model.config, self.settings, dtype, backend, device.type, free_port(), lora)
                url = process.url
        else:
            url = None
        url = from_rank0(url)
        client = ServerClient(url, self.settings.timeout_s, process.describe if process else None)
        if process is not None:
            process.wait_healthy(client, self.settings.start_timeout_s)
        barrier()
        self.servers[key] = _Server(client, process, dtype)
        return self.servers[key]

    def sync(self, agent: Agent) -> _Server:
        """``agent``'s server holding its current weights (every rank: the same gathers; rank 0 sends): the
        model's, or for an adapter of a LoRA team its base's and its adapter; the prefix cache emptied after
        any change."""
        server = self.server(agent)
        model, adapter = served(agent)
        check_serving_dtype(self.name, agent, server.dtype)
        version = base_version(agent)
        changed = server.version != version
        if changed:
            with base_alone(model) if adapter else contextlib.nullcontext():  # a LoRA team: the base alone
                self._send(server, model)
            server.version = version
            self.syncs += 1
        applied = request_adapter(agent)  # None: the base alone (no adapter, or the adapters off)
        if applied is not None:
            changed |= self._load_adapter(agent, server, applied)
        if changed and rank() == 0:
            reply = server.client.post("/reset_prefix_cache")
            if isinstance(reply, dict) and reply.get("success") is False:
                raise server.client.error("/reset_prefix_cache", "the prefix cache was not emptied (requests running)")
        return server

    def _send(self, server: _Server, model: torch.nn.Module) -> None:
        """``model``'s weights by the transfer protocol (rank 0 sends; the others run the same gathers)."""
        torch_dtype = getattr(torch, server.dtype)
        tensors = effective_weights(model, torch_dtype)
        if rank() != 0:
            for _ in tensors:  # the gathers rank 0's stream runs, in the same order
                pass
            return
        if server.sender is None:
            device_type = next(model.parameters()).device.type
            host = urlparse(server.client.url).hostname
            server.sender = make_sender(
                self.transport(device_type), server.client, reachable_address(host), self.settings.timeout_s
            )
            server.sender.connect()
        server.sender.send(served_metadata(model, torch_dtype), tensors, str(self.syncs + 1))

    def _load_adapter(self, agent: Agent, server: _Server, adapter: str) -> bool:
        """``agent``'s adapter on its base's server, saved and loaded (in place, under the adapter's name)
        when its weights changed since it was last loaded; whether it was."""
        version = adapter_version(agent, adapter)
        known = server.adapters.get(adapter)
        if known is not None and known[0] == version:
            return False
        self.adapter_syncs += 1
        folder = None
        if rank() == 0:
            if self.settings.adapter_dir is None and self.folder is None:
                self.folder = tempfile.TemporaryDirectory(prefix="lit_marl_server_adapters_")
            root = self.settings.adapter_dir or self.folder.name
            os.makedirs(root, exist_ok=True)
            folder = tempfile.mkdtemp(prefix=f"{adapter}-", dir=root)  # a run's own, beside other runs' in adapter_dir
            try:
                agent.model.save_adapter(Path(folder))
                body = {"lora_name": adapter, "lora_path": os.path.abspath(folder), "load_inplace": True}
                server.client.post("/v1/load_lora_adapter", body)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            if known is not None and known[1] is not None:  # the version before: replaced, not read again
                shutil.rmtree(known[1], ignore_errors=True)
        server.adapters[adapter] = (version, folder)
        return True

    @contextlib.contextmanager
    def rollout(self, agents):
        """Every distinct model synced, in order, then the rollout (no rank starts before every sync ended).
        The requests' seeds come from a generator of the engine's, seeded here from the run's: a rollout
        generated in the background (``data.max_staleness``) draws nothing from the run's generators."""
        for agent in each_served(agents):
            self.sync(agent)
        self.seeds = torch.Generator().manual_seed(stream_seed(int(torch.randint(0, 2**62, ())), rank()))
        barrier()
        yield

    def draw_seed(self) -> int:
        """A seed from the engine's generator (seeded from the run's at each rollout): the base of a rollout's
        per-episode sampling streams (``data.turns: independent``), drawn by the thread the rollout runs in."""
        with self.lock:
            return int(torch.randint(0, 2**31, (), generator=self.seeds))

    def generate_team(self, calls, sampling, seeds=None):
        """One ``generate`` per call; ``seeds`` (per call, one per prompt) are the requests' seeds."""
        return [
            self.generate(agent, prompts, n, sampling, None if seeds is None else seeds[k])
            for k, (agent, prompts, n) in enumerate(calls)
        ]

    @torch.no_grad()
    def generate(
        self,
        agent: Agent,
        prompts: list[list[int]],
        num_samples: int,
        sampling: Sampling,
        seeds: list[int] | None = None,
    ) -> Generation:
        """Every prompt one request, all in flight at once; request i seeded ``seeds[i]``, else from the
        engine's generator."""
        applied = request_adapter(agent)  # an adapter of a LoRA team, or None: the base alone
        with self.lock:
            server = self.servers.get(id(served(agent)[0]))
            if server is None or server.version is None or (applied is not None and applied not in server.adapters):
                server = self.sync(agent)  # never sent: now (else the last rollout's sync holds)
            if seeds is None:  # a seeded run samples alike; vLLM seeds sample k of a request seed + k
                base = int(torch.randint(0, 2**62, (), generator=self.seeds))
                seeds = [base + i * num_samples for i in range(len(prompts))]
        params = sampling_params(sampling, num_samples, [agent.eos_token_id])
        params.update(min_p=0.0, skip_special_tokens=False)
        copies = 1
        if sampling.greedy and num_samples > 1:  # the server refuses n > 1 when greedy: one sample, copied
            params["n"], copies = 1, num_samples
        bodies = [
            {"model": applied or SERVED_NAME, "token_ids": prompt, "sampling_params": dict(params, seed=int(seed))}
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]
        replies = list(self.pool.map(lambda body: server.client.post("/inference/v1/generate", body), bodies))
        outputs = [[sample for sample in _samples(server.client, reply) for _ in range(copies)] for reply in replies]
        return generation_of(agent, prompts, num_samples, outputs, sampling.max_new_tokens)

    def close(self) -> None:
        """Stop the servers the run started (they are started again if a later rollout asks) and delete the
        adapters saved for them."""
        for server in self.servers.values():
            if server.process is not None:
                server.process.stop()
            for _, folder in server.adapters.values():
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
        self.servers.clear()
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None


def _samples(client: ServerClient, reply) -> list[Sample]:
    try:
        return [
            Sample(
                list(choice["token_ids"]),
                choice["finish_reason"],
                [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []] or None,
            )
            for choice in reply["choices"]
        ]
    except (KeyError, TypeError) as error:
        raise client.error(
            "/inference/v1/generate", f"a reply without token ids ({error!r}): {str(reply)[:300]}"
        ) from error


__all__ = ["ServerError", "ServerSettings", "VLLMServerEngine"]
