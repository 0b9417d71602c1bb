"""Evaluation metrics and a step's log under two gloo ranks. ``data.evaluate`` on the held-out slogan
tasks with a scripted ``evaluation_metrics`` (outcomes a function of the task: no model), each rank
playing every second task, keys that only some batches report, pass@k; and ``StepLog.reduce`` with
records that differ by rank. Each rank writes what it got to OUT/metrics_rank{r}.json; the test
compares them with one process's results."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import slogan_data  # noqa: E402
from lit_marl.metrics import StepLog  # noqa: E402


def scripted(agents, tasks, num_samples=1):
    """Per task i (its id's number): reward i/32; ``late`` only for ids over 20 (a key some ranks'
    batches lack); ``won/<topic>`` of each topic; of num_samples samples the first i % (n+1) succeed."""
    ids = [int(t["id"].split("-")[1]) for t in tasks]
    metrics = {"reward": sum(i / 32 for i in ids) / len(ids)}
    late = [i for i in ids if i > 20]
    if late:
        metrics["late"] = (sum(late) / len(late), len(late))
    for topic in sorted({t["topic"] for t in tasks}):
        mine = [i for i, t in zip(ids, tasks) if t["topic"] == topic]
        metrics[f"won/{topic}"] = (sum(i % 2 for i in mine) / len(mine), len(mine))
    return metrics, (torch.full((len(ids),), num_samples), torch.tensor([i % (num_samples + 1) for i in ids]))


def evaluate(rank: int, world: int) -> dict:
    data = slogan_data(eval_tasks_per_step=5)
    data.evaluation_metrics = scripted
    data.trainer = SimpleNamespace(global_rank=rank, world_size=world, strategy=SimpleNamespace(root_device="cpu"))
    return data.evaluate(None, num_samples=4, pass_at_k=[1, 2, 4])


def step_log(rank: int) -> dict:
    log = StepLog()
    log.add({"loss": 1.0 + rank}, weight=1 + rank)  # weighted mean: (1*1 + 2*2) / 3
    log.add({f"only_rank{rank}": 5.0})
    log.add({"peak": 10.0 * (rank + 1)}, reduce="max")
    log.add({"tokens": 100.0}, reduce="sum")
    log.distribution("reward", torch.arange(3.0) + 3 * rank)  # rank 0: 0 1 2, rank 1: 3 4 5
    scalars, distributions = log.reduce()
    return {"scalars": scalars, "reward": distributions["reward"].tolist()}


def run(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = {"evaluate": evaluate(rank, 2), "step_log": step_log(rank)}
    (Path(out) / f"metrics_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2]), nprocs=2)
