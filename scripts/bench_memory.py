"""The memory plan against a measured peak: runs one ``lit-marl fit`` in a child process (a config,
with overrides), reads the plan it prints before the first step, and compares the plan's peak with
the child's peak RSS (``getrusage``). Prints one line per run.

    .venv/bin/python scripts/bench_memory.py --config configs/magrpo/slogan_tiny.yaml \\
        --set model.init_args.model=smollm2-135m-instruct --set model.init_args.memory.forward_token_budget=4096

On CPU, glibc keeps freed heap memory mapped (its mmap threshold grows after each large free), so
the RSS exceeds the live bytes; ``--malloc-return`` runs the child with ``MALLOC_MMAP_THRESHOLD_=131072``,
which returns large blocks to the system when freed (docs/scale.md).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/magrpo/slogan_tiny.yaml")
    parser.add_argument("--set", action="append", default=[], help="a dotted override KEY=VALUE (repeatable)")
    parser.add_argument("--malloc-return", action="store_true", help="MALLOC_MMAP_THRESHOLD_=131072 in the child")
    parser.add_argument("--out", default="/tmp/lit_marl_bench_memory")
    args = parser.parse_args()
    command = [sys.executable, "-m", "lit_marl.cli", "fit", "--config", args.config]
    command += ["--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0", "--trainer.max_epochs=1"]
    command += [f"--trainer.default_root_dir={args.out}", "--trainer.logger=false"]
    command += [f"--{item}" if "=" in item else item for item in args.set]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.malloc_return:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"the fit failed ({done.returncode}):\n{output[-3000:]}")
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    plan = output[output.index("memory plan per rank") :].split("\n\n")[0]
    planned = float(re.search(r"peak\s+([\d.]+) GiB", plan).group(1))
    print(plan.split("\n  note")[0])
    measured = peak_rss / 2**30
    print(
        f"planned peak {planned:.2f} GiB, measured peak RSS {measured:.2f} GiB: planned/measured "
        f"{planned / measured:.2f} ({'malloc returns freed blocks' if args.malloc_return else 'glibc default'})"
    )


if __name__ == "__main__":
    main()
