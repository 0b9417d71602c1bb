"""Time quickstart-shaped training steps on this CPU: precision x thread settings, quiet and under load.

    .venv/bin/python scripts/bench_cpu.py                       # the table in docs/quickstart.md
    .venv/bin/python scripts/bench_cpu.py --emulate-no-bf16     # as a CPU without bf16 units would
    .venv/bin/python scripts/bench_cpu.py --loads 0 --precisions auto --threads lit-marl --repeats 1

Each cell is one `lit-marl fit --config configs/quickstart.yaml` of ``--steps`` training steps (SmolLM2,
2 agents, 4 tasks x 8 samples a step, LoRA; the held-out evaluation callback removed), read back from
its TensorBoard scalars (``perf/step_s`` = generation + update, per step). Cells alternate (the order
flips every repeat) so a change in the machine's own load falls on every setting alike.

- ``--threads default``: torch's and OpenMP's defaults, as a process gets them with nothing set:
  ``OMP_NUM_THREADS`` = the CPUs, OpenMP's own wait (libgomp spins ~300,000 rounds before it sleeps:
  ``GOMP_SPINCOUNT``). ``lit-marl``: nothing set, the package's choice (``lit_marl/cpu.py``).
  ``NAME=VALUE[,...]``: the package's choice with these variables set (``GOMP_SPINCOUNT=20000``).
- ``--loads``: busy processes started beside the run (a pure-Python spin loop each); ``cpus`` = one per
  usable CPU.
- ``--emulate-no-bf16``: oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``): bf16 is emulated as on a CPU
  without bf16 units, and ``auto`` picks what it would pick there.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lit_marl.cpu import cpu_flags, usable_cpus  # noqa: E402

FLAGS_SHOWN = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16", "bf16")
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "LIT_MARL_OMP_NUM_THREADS")
CHOICE = re.compile(r"lit-marl: CPU run: precision ([^\s;]+)")


def cell_env(threads: str, emulate_no_bf16: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV and k != "LIT_MARL_PRECISION"}
    env["HF_HUB_OFFLINE"] = "1"
    if threads == "default":
        env.update(OMP_NUM_THREADS=str(usable_cpus()), GOMP_SPINCOUNT="300000")
    elif threads != "lit-marl":  # NAME=VALUE[,NAME=VALUE...]: the package's choice with these set
        env.update(item.split("=", 1) for item in threads.split(","))
    if emulate_no_bf16:
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    return env


def step_seconds(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for version in sorted(run_dir.glob("*/version_*")):
        events = EventAccumulator(str(version))
        events.Reload()
        for key in ("perf/step_s", "perf/generate_s", "perf/train_s"):
            if key in events.Tags()["scalars"]:
                found[key] = [e.value for e in events.Scalars(key)]
    return found


def run_cell(args, precision: str, threads: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_cpu_") as out:
        command = [
            str(ROOT / ".venv/bin/lit-marl"), "fit", "--config", str(ROOT / args.config),
            "--trainer.limit_train_batches", str(args.steps), "--trainer.callbacks", "[]",
            "--trainer.logger.init_args.save_dir", out, "--seed_everything", "0",
        ]  # fmt: skip
        if precision != "auto":
            command += ["--trainer.precision", precision]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=cell_env(threads, args.emulate_no_bf16), capture_output=True, text=True,
                timeout=args.timeout,
            )  # fmt: skip
            log, failed = done.stdout + done.stderr, done.returncode != 0
        except subprocess.TimeoutExpired as err:
            log, failed = str(err.stderr or ""), f"timed out after {args.timeout} s"
        seconds = time.perf_counter() - start
        chosen = CHOICE.search(log)
        result = {"wall_s": seconds, "precision": chosen.group(1) if chosen else precision, **step_seconds(Path(out))}
        if failed:
            result["failed"] = failed if isinstance(failed, str) else log.strip().splitlines()[-1:]
        return result


def busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"], help="or auto (unset)")
    parser.add_argument("--threads", nargs="+", default=["default", "lit-marl"], help="default, lit-marl, NAME=VALUE")
    parser.add_argument("--loads", nargs="+", default=["0", "cpus"], help="busy processes: a number or cpus")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell (its steps so far are kept)")
    parser.add_argument("--emulate-no-bf16", action="store_true")
    args = parser.parse_args()

    flags = cpu_flags()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    print(f"CPU: {model}; {usable_cpus()} usable cores; flags: {' '.join(f for f in FLAGS_SHOWN if f in flags) or '-'}")
    if args.emulate_no_bf16:
        print("emulating a CPU without bf16 units: ONEDNN_MAX_CPU_ISA=AVX2")
    cells = [(load, p, t) for load in args.loads for p in args.precisions for t in args.threads]
    results: dict[tuple, list[dict]] = {cell: [] for cell in cells}
    for repeat in range(args.repeats):
        for load in args.loads:
            order = [c for c in cells if c[0] == load]
            order = order if repeat % 2 == 0 else order[::-1]
            workers = busy(usable_cpus() if load == "cpus" else int(load))
            try:
                for cell in order:
                    result = run_cell(args, cell[1], cell[2])
                    results[cell].append(result)
                    steps = " ".join(f"{s:.1f}" for s in result.get("perf/step_s", []))
                    print(f"  repeat {repeat} load={cell[0]} {cell[1]}->{result['precision']} threads={cell[2]}: "
                          f"steps [{steps}] s, whole run {result['wall_s']:.0f} s {result.get('failed', '')}",
                          flush=True)  # fmt: skip
            finally:
                for worker in workers:
                    worker.kill()
    print("\n| busy processes | threads | precision | s/step (median) | generation s | update s | whole run s |")
    print("|---|---|---|---|---|---|---|")
    for (load, precision, threads), runs in results.items():
        keys = ("perf/step_s", "perf/generate_s", "perf/train_s")
        column = {key: [v for r in runs for v in r.get(key, [])] for key in keys}
        shown = [f"{statistics.median(v):.1f}" if v else "-" for v in column.values()]
        chosen = "/".join(sorted({r["precision"] for r in runs}))
        label = f"auto ({chosen})" if precision == "auto" else precision
        whole = "/".join(f"{r['wall_s']:.0f}" + ("!" if "failed" in r else "") for r in runs)
        print(f"| {load} | {threads} | {label} | {' | '.join(shown)} | {whole} |")
    print("\n(! = the run failed or timed out; its finished steps are counted)")


if __name__ == "__main__":
    main()
