"""Two gloo ranks call ``padded_steps`` with per-turn groups that differ by rank; each writes the
turn of every step it takes (None: it joins with no rows) to OUT/steps_rank{r}.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_marl.parallel.collectives import padded_steps

# rank 0: turn 0 has 3 mini-batches, turn 1 has 1; rank 1: turn 0 has 1, turn 1 has 2, turn 2 has 1
GROUPS = {0: [0, 0, 0, 1], 1: [0, 1, 1, 2]}


def run(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups = GROUPS[rank]
    batches = [f"turn{g}" for g in groups]
    steps = padded_steps(batches, torch.device("cpu"), groups)
    (Path(out) / f"steps_rank{rank}.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], sys.argv[2]), nprocs=2)
