"""Sandboxed programs per second for a turn's worth of rewards: serial vs the pool.

    .venv/bin/python scripts/bench_sandbox.py --programs 64

Each program defines a small function with three tests. ``plain`` runs program + asserts as one
sandboxed script (``run_python``); ``harness`` runs them as the code reward does (``run_tests``:
the two-process harness, each test recorded on its own). Prints one JSON line per mode, then the
speed-ups of the pool.
"""

from __future__ import annotations

import argparse
import json
import time

from lit_marl.envs.code import run_tests, split_tests
from lit_marl.sandbox import Limits, bubblewrap_available, run_many, run_python

FUNCTION = """
def add_digits(n):
    return sum(int(c) for c in str(abs(n)))
"""
TESTS = """
def check(candidate):
    assert candidate(123) == 6
    assert candidate(-45) == 9
    assert candidate({i}) == {expected}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: twice the CPU count)")
    args = parser.parse_args()
    suites = [TESTS.format(i=i, expected=sum(int(c) for c in str(i))) for i in range(args.programs)]
    plain = [FUNCTION + t + "\ncheck(add_digits)\n" for t in suites]
    jobs = [(FUNCTION, split_tests(t, "add_digits"), "add_digits") for t in suites]
    limits = Limits(wall_s=10)
    rates = {}
    for kind in ("plain", "harness"):
        for mode in ("serial", "pool"):
            workers = 1 if mode == "serial" else args.workers
            start = time.perf_counter()
            if kind == "plain":
                results = (
                    [run_python(p, limits) for p in plain] if mode == "serial" else run_many(plain, limits, workers)
                )
                passed = sum(r.ok for r in results)
            else:
                passed = sum(r.passed_frac == 1.0 for r in run_tests(jobs, max_workers=workers))
            seconds = time.perf_counter() - start
            rates[kind, mode] = len(plain) / seconds
            line = {"kind": kind, "mode": mode, "programs": len(plain), "passed": passed}
            line |= {"seconds": round(seconds, 3), "programs_per_s": round(rates[kind, mode], 1)}
            print(json.dumps(line | {"bubblewrap": bubblewrap_available()}))
    print(
        json.dumps(
            {
                f"{kind}_pool_speedup": round(rates[kind, "pool"] / rates[kind, "serial"], 2)
                for kind in ("plain", "harness")
            }
        )
    )


if __name__ == "__main__":
    main()
