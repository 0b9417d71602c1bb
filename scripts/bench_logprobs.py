"""The training forward of a multi-turn episode: full-vocabulary logits at every position
(``sequence_logprobs``) against the LM head on only the agent's own tokens (``masked_logprobs``).
Each mode runs in its own process, so its peak RSS is its own; prints seconds per forward+backward
and the peak RSS above the loaded model.

    python scripts/bench_logprobs.py --model smollm2-135m-instruct --rows 4 --length 3000 --reply-share 0.1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(args) -> dict:
    import torch

    from lit_marl.agents import Agent, LoraSettings
    from lit_marl.logprobs import masked_logprobs, sequence_logprobs

    torch.manual_seed(0)
    agent = Agent(args.model, LoraSettings(r=16))
    vocab = agent.model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.length))
    attention = torch.ones_like(ids)
    mask = torch.rand(ids.shape) < args.reply_share
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        if args.mode == "full":
            loss = -(sequence_logprobs(agent.model, ids, attention) * mask).sum()
        else:
            loss = -masked_logprobs(agent.model, ids, attention, mask)[0].sum()
        loss.backward()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "mode": args.mode,
        "s_per_pass": min(times),
        "peak_above_model_mb": (peak - base) / 1024,
        "loss": float(loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=3000)
    parser.add_argument("--reply-share", type=float, default=0.1, help="share of tokens that are the agent's own")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mode", choices=["full", "masked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    rows = []
    for mode in ("full", "masked"):
        out = subprocess.run([sys.executable, *sys.argv, "--mode", mode], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for row in rows:
        print(
            f"{row['mode']:>6}: {row['s_per_pass']:.2f} s per forward+backward, "
            f"peak RSS +{row['peak_above_model_mb']:.0f} MB, loss {row['loss']:.2f}"
        )
    full, masked = rows
    print(
        f"masked/full: time {masked['s_per_pass'] / full['s_per_pass']:.2f}, "
        f"peak {masked['peak_above_model_mb'] / max(full['peak_above_model_mb'], 1):.2f}"
    )


if __name__ == "__main__":
    main()
