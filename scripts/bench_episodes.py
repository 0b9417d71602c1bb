"""Env steps and generated tokens per second for 64 parallel episodes of the Corridor game.

    .venv/bin/python scripts/bench_episodes.py --episodes 64 --max-turns 6 --max-new-tokens 8

One batched generate per turn over all live episodes; the environments step in a thread pool.
``--kept-kv-gib 0 4`` compares the lean engine re-reading every history (0) with keeping each
episode's KV cache between turns (4 GiB), alternating within each repeat. Prints one JSON line per
repeat and setting and a summary line per setting (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_workload as workload  # noqa: E402

from lit_marl.generation import Sampling


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--env-workers", type=int, default=8)
    parser.add_argument("--kept-kv-gib", type=float, nargs="+", default=[4.0], help="0: re-read every history")
    args = parser.parse_args()

    import torch

    from lit_marl.agents import Agent
    from lit_marl.envs import make_env
    from lit_marl.generation import TorchEngine
    from lit_marl.rollout.episode import EpisodeSettings, run_episodes
    from lit_marl.tasks import load_tasks

    torch.set_num_threads(args.threads)
    agent = Agent(args.model)
    agent.model.requires_grad_(False)
    rows = load_tasks("data/corridor/train.jsonl", "tasks", set())
    tasks = [rows[i % len(rows)] for i in range(args.episodes)]
    env = make_env("corridor")
    env.pool = ThreadPoolExecutor(args.env_workers)
    results = []
    for repeat in range(args.repeats):
        for gib in args.kept_kv_gib:
            engine = TorchEngine(fallback=True, kept_kv_gib=gib)
            torch.manual_seed(repeat)
            with torch.no_grad(), engine.rollout([agent]):
                settings = EpisodeSettings(
                    max_turns=args.max_turns, sampling=Sampling(max_new_tokens=args.max_new_tokens)
                )
                (batch,) = run_episodes([agent], tasks, env, settings, engine=engine)
            s = batch.stats
            line = {
                "repeat": repeat,
                "kept_kv_gib": gib,
                "episodes": args.episodes,
                "env_steps": int(s["train/env_steps"]),
                "seconds": round(s["perf/rollout_s"], 3),
                "env_steps_per_s": round(s["perf/env_steps_per_s"], 1),
                "generated_tokens_per_s": round(s["perf/generated_tokens"] / s["perf/rollout_s"], 1),
                "generate_share": round(s["perf/generate_s"] / s["perf/rollout_s"], 3),
                "env_share": round(s["perf/env_s"] / s["perf/rollout_s"], 4),
                "prompt_tokens_reused": engine.prefill[0],
                "prompt_tokens_computed": engine.prefill[1],
            }
            results.append(line)
            print(json.dumps(line), flush=True)
    for summary in workload.medians_by(results, "kept_kv_gib"):
        print(json.dumps({"model": args.model, **summary}))


if __name__ == "__main__":
    main()
