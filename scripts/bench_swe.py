"""SWE environment costs: workspace setup, one sandboxed test run, and scripted episodes per
second serial and in parallel (the known fix as tool calls, then submit: two or three tool calls and
one scoring run per episode; no model). Prints numbers; compare them as ratios in one run.

    python scripts/bench_swe.py [--episodes 12] [--workers 4]
"""

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from lit_marl.envs.swe.env import SWEEnv, workspaces
from lit_marl.envs.swe.instances import normalize, resolve_source, snapshot
from lit_marl.envs.swe.scoring import TestSettings, run_tests
from lit_marl.envs.swe.workspace import Workspace, default_root
from lit_marl.sandbox import bubblewrap_available


def expert_episode(row: dict) -> float:
    env = SWEEnv()
    env.start(row)
    for turn in env.expert_turns(row):
        result = env.act(turn)
    return result.info["score"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(resolve_source("swe:bundled:all"))]
    row = normalize(dict(rows[0]), "bench")
    files = snapshot(row, None)
    print(f"bubblewrap: {bubblewrap_available()}; {len(rows)} bundled instances")

    setup = []
    for _ in range(20):
        start = time.perf_counter()
        ws = Workspace(default_root(), files)
        setup.append(time.perf_counter() - start)
        ws.remove()
    print(f"workspace setup: median {1e3 * statistics.median(setup):.1f} ms ({len(files)} files)")

    ws = Workspace(default_root(), files)
    tests = row["FAIL_TO_PASS"] + row["PASS_TO_PASS"]
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        report, _ = run_tests(ws, tests, [], TestSettings())
        runs.append(time.perf_counter() - start)
        assert report is not None
    ws.remove()
    print(
        f"test run ({len(tests)} tests, sandboxed pytest): "
        f"median {statistics.median(runs):.2f} s, min {min(runs):.2f} s"
    )

    episodes = [rows[i % len(rows)] for i in range(args.episodes)]
    for workers in (1, args.workers):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            scores = list(pool.map(expert_episode, episodes))
        seconds = time.perf_counter() - start
        assert all(score == 1.0 for score in scores)
        print(
            f"expert episodes, {workers} worker(s): {len(episodes) / seconds:.2f} episodes/s "
            f"({seconds:.1f} s for {len(episodes)})"
        )
    print(f"workspaces left: {len(workspaces())}")


if __name__ == "__main__":
    main()
