"""Activation checkpointing measured: peak memory and time of one training pass (forward + backward of
the completion log-probs, as an update computes them) with and without ``activation_checkpointing``,
next to the memory plan's estimate of the pass (``lit_marl.memory``: gradients and activations).
glibc keeps freed heap memory mapped (its mmap threshold grows with each large free), so the peak
RSS of a pass exceeds what was live; with ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment large
blocks go back to the system when freed and the RSS follows the live bytes (docs/scale.md).

Each setting runs in a fresh process (its peak RSS is its own); the times are compared as ratios
within one run (the machine is shared). Prints one line per setting and the ratios.

    .venv/bin/python scripts/bench_checkpointing.py --model smollm2-135m-instruct --rows 4 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def one(model: str, rows: int, tokens: int, lora: bool, checkpointing: bool, repeats: int) -> dict:
    import torch

    from lit_marl.activations import activation_profile
    from lit_marl.agents import Agent, LoraSettings
    from lit_marl.logprobs import completion_logprobs
    from lit_marl.memory import GiB
    from lit_marl.models import checkpoint_layers, checkpointed_passes

    torch.manual_seed(0)
    agent = Agent(model, LoraSettings() if lora else None)
    checkpoint_layers(agent, checkpointing)
    vocab = agent.model.config.vocab_size
    ids = torch.randint(3, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    # the memory plan of the pass: fp32 gradients of the trained weights, the measured activation profile
    grads = sum(p.numel() * 4 for p in agent.model.parameters() if p.requires_grad)
    profile = activation_profile(agent.model)
    planned = (grads + profile.pass_bytes(rows * tokens, rows * (tokens // 4), checkpointing)) / GiB
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux: KiB)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        with checkpointed_passes(agent):
            completion_logprobs(agent.model, ids, mask, tokens // 4).sum().backward()
        seconds.append(time.perf_counter() - start)
        agent.model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "loaded_gib": loaded,
        "peak_gib": peak,
        "pass_gib": peak - loaded,
        "planned_gib": planned,
        "s": min(seconds),
    }


def ratio(a: float, b: float) -> float:
    """a / b; nan where b is 0 (a tiny model's pass may not raise the peak RSS over the loaded one)."""
    return a / b if b else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per row (the last quarter scored)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--variants", nargs="+", default=["full", "lora"], choices=["full", "lora"], help="full weights, LoRA or both"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting, print its JSON
    args = parser.parse_args()
    if args.one:
        lora, checkpointing = (s == "1" for s in args.one.split(","))
        print(json.dumps(one(args.model, args.rows, args.tokens, lora, checkpointing, args.repeats)))
        return
    results = {}
    variants = [variant == "lora" for variant in dict.fromkeys(args.variants)]
    for lora in variants:
        for checkpointing in (False, True):
            command = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows)]
            command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            command += ["--one", f"{int(lora)},{int(checkpointing)}"]
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
            if done.returncode != 0:
                sys.exit(f"the setting {command[-1]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results[lora, checkpointing] = result
            name = f"{'lora' if lora else 'full'} {'checkpointed' if checkpointing else 'plain':12s}"
            print(
                f"{name} peak {result['peak_gib']:.2f} GiB (pass {result['pass_gib']:.2f} GiB over the loaded "
                f"{result['loaded_gib']:.2f}; planned {result['planned_gib']:.2f}) | {result['s']:.2f} s per pass",
                flush=True,
            )
    for lora in variants:
        plain, checkpointed = results[lora, False], results[lora, True]
        memory, seconds = (ratio(checkpointed[key], plain[key]) for key in ("pass_gib", "s"))
        print(
            f"{'lora' if lora else 'full'}: checkpointing keeps {memory:.2f}x "
            f"the pass's memory, takes {seconds:.2f}x its time "
            f"({args.rows} rows x {args.tokens} tokens, {args.model})"
        )


if __name__ == "__main__":
    main()
