"""Sandboxed programs per second for a turn's worth of rewards: serial vs the pool.

    .venv/bin/python scripts/bench_sandbox.py --programs 64

Each program defines a small function and runs three asserts against it (like a code task's tests).
Prints one JSON line per mode, and a last line with the speed-up.
"""

from __future__ import annotations

import argparse
import json
import time

from lit_marl.sandbox import Limits, bubblewrap_available, run_many, run_python

PROGRAM = """
def add_digits(n):
    return sum(int(c) for c in str(abs(n)))

assert add_digits(123) == 6
assert add_digits(-45) == 9
assert add_digits({i}) == sum(int(c) for c in str({i}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    programs = [PROGRAM.format(i=i) for i in range(args.programs)]
    limits = Limits(wall_s=10)
    rates = {}
    for mode in ("serial", "pool"):
        start = time.perf_counter()
        if mode == "serial":
            results = [run_python(p, limits) for p in programs]
        else:
            results = run_many(programs, limits, max_workers=args.workers)
        seconds = time.perf_counter() - start
        rates[mode] = len(programs) / seconds
        line = {"mode": mode, "programs": len(programs), "passed": sum(r.ok for r in results)}
        line |= {"seconds": round(seconds, 3), "programs_per_s": round(rates[mode], 1)}
        print(json.dumps(line | {"bubblewrap": bubblewrap_available()}))
    print(json.dumps({"pool_speedup": round(rates["pool"] / rates["serial"], 2)}))


if __name__ == "__main__":
    main()
