"""Two ranks (gloo) shard the tiny model per layer (``TeamShards(mode="per_layer")``) and sync it into a
``VLLMEngine`` whose backend records what it receives, as a rollout does under per-layer FSDP (the
policy not gathered: vLLM serves its own copy). Each rank reports: the names and dtypes received,
whether they equal the full weights, the most tensors and bytes alive at once in the stream, whether
the tied embedding was made once, and every collective of the rollout block (traced), split into
those of the sync and those after it. Writes OUT/report_rank{r}.json.

python fsdp_vllm_sync.py OUT PORT
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # collective_trace

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


class RecordingBackend:
    """Consumes the weight stream one tensor at a time, as vLLM's reload does, keeping a checksum."""

    sleeps = False

    def __init__(self, trace):
        self.trace, self.alive, self.most, self.most_bytes, self.bytes = trace, {}, 0, 0, 0
        self.received: dict[str, tuple[str, float]] = {}
        self.ids: dict[str, int] = {}
        self.sync_calls = 0

    def load_weights(self, weights):
        for name, tensor in weights:
            key = id(tensor)
            if key not in self.alive:
                self.alive[key] = tensor.numel() * tensor.element_size()
                weakref.finalize(tensor, self.alive.pop, key, None)
            self.most = max(self.most, len(self.alive))
            self.most_bytes = max(self.most_bytes, sum(self.alive.values()))
            self.received[name] = (str(tensor.dtype), float(tensor.double().sum()))
            self.ids[name] = key
            del tensor
        self.sync_calls = len(self.trace.calls)

    def generate(self, prompts, params, adapter=None):
        from lit_marl.generation.vllm import Sample

        return [[Sample([5, 6], "length", [-1.0, -1.0]) for _ in range(params["n"])] for _ in prompts]


def worker(rank: int, world: int, folder: str, port: str) -> None:
    from collective_trace import CollectiveTrace
    from torch.distributed.device_mesh import init_device_mesh

    from lit_marl.agents import Agent
    from lit_marl.generation import Sampling
    from lit_marl.generation.vllm import VLLMEngine
    from lit_marl.parallel.fsdp import TeamShards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    agent = Agent("tiny-random")
    lm = agent.model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # tied, as SmolLM2 and small Qwen2
    full = {
        n: (str(torch.bfloat16), float(p.detach().to(torch.bfloat16).double().sum()))
        for n, p in lm.state_dict().items()
    }
    largest = max(p.numel() * 2 for p in lm.parameters())  # bytes in bf16
    shards = TeamShards([lm], init_device_mesh("cpu", (world,)), "per_layer")
    with CollectiveTrace() as trace:
        backend = RecordingBackend(trace)
        engine = VLLMEngine(backend_factory=lambda a, dtype: backend)
        with torch.autocast("cpu", dtype=torch.bfloat16), shards.gathered([]), engine.rollout([agent]):
            for _ in range(3):
                engine.generate(agent, [[5, 6, 7]], 2, Sampling(max_new_tokens=2))
    report = {
        "rank": rank,
        "names_match": sorted(backend.received) == sorted(full),
        "dtypes": sorted({d for d, _ in backend.received.values()}),
        "values_match": all(abs(backend.received[n][1] - full[n][1]) < 1e-3 for n in full),
        "most_alive": backend.most,
        "most_bytes": backend.most_bytes,
        "largest_bytes": largest,
        "tied_once": backend.ids["lm_head.weight"] == backend.ids["model.embed_tokens.weight"],
        "syncs": engine.syncs,
        "sync_collectives": trace.calls[: backend.sync_calls],
        "after_sync": trace.calls[backend.sync_calls :],
        "sharded": sum(type(p).__name__ == "DTensor" for p in lm.parameters()),
    }
    (Path(folder) / f"report_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
