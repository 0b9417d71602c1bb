"""Two ranks (gloo) shard the tiny model in the gathered mode and take an optimizer step inside
``gathered()`` (reduce, step, refresh), as an update does. ``weight_version`` (what an engine with its
own copy of the weights compares before generating) must change: the next gathered block holds
other weights; gathered again without a step it must not (an engine would reload for nothing).
Writes OUT/report_rank{r}.json.

python fsdp_versions.py OUT PORT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def worker(rank: int, world: int, folder: str, port: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lit_marl.generation.weights import weight_version
    from lit_marl.models import load_model_and_tokenizer
    from lit_marl.parallel.fsdp import TeamShards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, _ = load_model_and_tokenizer("tiny-random")
    shards = TeamShards([model], init_device_mesh("cpu", (world,)), "gathered")
    params = list(model.parameters())  # the shards, as an optimizer holds them
    optimizer = torch.optim.SGD(params, lr=0.1)
    with shards.gathered():
        before, weights = weight_version(model), next(model.parameters()).clone()
        again = weight_version(model)
    with shards.gathered():  # gathered again, nothing stepped: the same weights, the same version
        regathered = weight_version(model)
    with shards.gathered():
        model(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
        shards.reduce_gradients(params)
        optimizer.step()
        shards.refresh(params)
    with shards.gathered():
        after, moved = weight_version(model), not torch.equal(next(model.parameters()), weights)
    report = {"moved": moved, "same_block_same_version": before == again, "version_changed": before != after}
    report["regathered_same_version"] = before == regathered
    (Path(folder) / f"report_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
