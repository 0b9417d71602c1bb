"""TextWorld costs on this machine: game generation per game (serial and parallel), env steps per
second, and the cost of a branch by copying the game state vs replaying the command prefix.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_textworld.py --games 8 --workers 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from lit_marl.envs.textworld import TextWorldEnv
from lit_marl.envs.textworld.games import make_games


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--complexity", default="w2-o3-q4")
    parser.add_argument("--games", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        seeds = list(range(1, args.games + 1))
        _, serial = make_games(args.complexity, seeds, f"{root}/serial", workers=1)
        _, parallel = make_games(args.complexity, seeds, f"{root}/parallel", workers=args.workers)
        print(
            f"generation {args.complexity}: serial {serial / args.games:.2f} s/game, "
            f"{args.workers} workers {parallel / args.games:.2f} s/game"
        )
        paths, _ = make_games(args.complexity, seeds, f"{root}/serial")
        # one game through its own methods (start / act / clone / replay_clone): the env's batched
        # protocol (reset(tasks), step(states, ...)) runs these per state
        env = TextWorldEnv()
        task = {"game": str(paths[0])}
        walkthrough = [t[0] for t in env.expert_turns(task)]
        env.start(task)
        start = time.perf_counter()
        for _ in range(args.repeats * 10):
            env.act(["look"])
        print(f"env steps: {args.repeats * 10 / (time.perf_counter() - start):.0f} steps/s")
        for prefix in (1, len(walkthrough) - 1, 20):
            env.start(task)
            for k in range(prefix):
                env.act([walkthrough[k] if k < len(walkthrough) - 1 else "look"])
            costs = {}
            for name, branch in (("clone", env.clone), ("replay", env.replay_clone)):
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    branch()
                    times.append(time.perf_counter() - t0)
                costs[name] = statistics.median(times) * 1000
            print(f"branch after {prefix} commands: clone {costs['clone']:.1f} ms, replay {costs['replay']:.1f} ms")


if __name__ == "__main__":
    main()
