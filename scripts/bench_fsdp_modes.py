"""What an update pass holds per rank in FSDP2's two modes, measured on CPU: two gloo ranks shard one
model (``TeamShards``, ``gathered`` or ``per_layer``), then run one forward/backward of a batch,
in a subprocess per mode. Each rank resets its peak RSS after sharding (``/proc/self/clear_refs``)
and reports the pass's peak above its resident memory, beside the plan's parts for that mode
(``lit_marl.memory.weight_parts``: the gathered weights and gradients a pass holds).

    .venv/bin/python scripts/bench_fsdp_modes.py --model smollm2-135m-instruct --rows 4 --tokens 256

Glibc's heap keeps freed blocks, so the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (large
tensors mapped and unmapped: the RSS follows the live bytes; docs/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 2**20


def rss(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1]) * 1024
    return 0.0


def worker(rank: int, world: int, port: int, args) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_marl.memory import weight_parts
    from lit_marl.models import load_model_and_tokenizer
    from lit_marl.parallel.fsdp import TeamShards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(args.model)
    model.train(False)
    holder = torch.nn.Module()
    holder.model = model
    planned, _ = weight_parts(holder, shard_over=world, mode=args.mode)
    shards = TeamShards([model], init_device_mesh("cpu", (world,)), args.mode)
    gc.collect()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(rank))
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    base = rss("VmRSS")
    context = shards.gathered() if args.mode == "gathered" else shards.updating()
    with context:
        for chunk in shards.lockstep([ids], [model], backward=True):
            model(input_ids=chunk, logits_to_keep=1).logits.float().sum().backward()
        shards.reduce_gradients(list(model.parameters()))
    peak = rss("VmHWM")
    held = {k: planned[k] / MiB for k in ("weights gathered for a step", "layers gathered in a pass") if k in planned}
    report = {"rank": rank, "pass_peak_mib": (peak - base) / MiB, "planned_gathered_mib": held}
    report["planned_gradients_mib"] = planned["gradients"] / MiB
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["gathered", "per_layer"], choices=["gathered", "per_layer"])
    parser.add_argument("--mode", choices=["gathered", "per_layer"], help="(internal: one mode in a child)")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.mode is not None:
        return worker(args.rank, 2, args.port, args)
    for mode in dict.fromkeys(args.modes):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        base = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows), "--tokens", str(args.tokens)]
        logs = [tempfile.TemporaryFile("w+") for _ in range(2)]  # a file, not a pipe: a full pipe would stall a rank
        ranks = [
            subprocess.Popen(
                [*base, "--mode", mode, "--rank", str(r), "--port", str(port)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=logs[r],
                text=True,
            )
            for r in range(2)
        ]
        for proc, log in zip(ranks, logs):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                log.seek(0)
                sys.exit(f"{mode}: a rank failed ({proc.returncode}):\n{log.read()[-3000:]}")
            report = json.loads(out.strip().splitlines()[-1])
            print(
                f"{mode:<9} rank {report['rank']}: pass peak {report['pass_peak_mib']:7.1f} MiB above resident; "
                f"plan: gathered {report['planned_gathered_mib']}, gradients {report['planned_gradients_mib']:.1f} MiB"
            )


if __name__ == "__main__":
    main()
