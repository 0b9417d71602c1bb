"""Kill training runs with SIGKILL at random moments, resume them, and check that nothing was lost.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak_kill_resume.py --trials 6 --steps 5 --kills 2

For each algorithm (MAGRPO with rollout buffers, IAC with two turns) one uninterrupted reference run
of ``--steps`` training steps (``tests/scripts/resume_run.py``: the tiny model, a checkpoint after
every step), then ``--trials`` runs that are each killed up to ``--kills`` times at a random moment
of their training (after the start-up, uniform over the reference's training time: a kill falls in
generation and the reward, the update or the checkpoint write)
and resumed from ``last.ckpt`` (from scratch when no checkpoint exists yet). Each checkpoint is
verified (``lit_marl.checkpoint_files.verify``: exists, not empty, matches its checksum, loads)
before the resume. At the end a trial's task order and final parameters are compared with the
reference's. Prints one JSON line per trial, then a table: kills per phase, runs resumed, tasks
lost and repeated, checkpoints corrupt, the largest parameter difference.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lit_marl import ConfigError
from lit_marl.checkpoint_files import verify

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "scripts" / "resume_run.py"


def start(out: Path, steps: int, algorithm: str, resume: Path | None) -> subprocess.Popen:
    command = [sys.executable, str(RUN), str(out), "--steps", str(steps), "--algorithm", algorithm]
    if resume is not None:
        command += ["--resume", str(resume)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def last_phase(out: Path) -> str:
    log = out / "phases.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return lines[-1].split()[0] if lines else "start-up"


def recorded_steps(checkpoint: Path) -> int:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    return next(v["steps"] for k, v in state["callbacks"].items() if k.startswith("Recorder"))


def phase_count(out: Path) -> int:
    log = out / "phases.log"
    return len(log.read_text().splitlines()) if log.is_file() else 0


def reference(root: Path, steps: int, algorithm: str) -> tuple[list[str], dict, float]:
    """The uninterrupted run: its tasks, parameters and the seconds of its training (from its
    first rollout to its end; the start-up before it is not where the kills should fall)."""
    out = root / f"reference_{algorithm}"
    proc = start(out, steps, algorithm, None)
    while proc.poll() is None and phase_count(out) == 0:
        time.sleep(0.02)
    began = time.perf_counter()
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{err.decode()[-2000:]}")
    tasks = (out / "tasks.jsonl").read_text().splitlines()
    return tasks, torch.load(out / "params.pt"), time.perf_counter() - began


def trial(root: Path, index: int, steps: int, algorithm: str, kills: int, duration: float, rng: random.Random):
    out = root / f"trial_{algorithm}_{index}"
    checkpoint = out / "checkpoints" / "last.ckpt"
    report = {"algorithm": algorithm, "trial": index, "kills": [], "resumed": 0, "corrupt": 0, "restarts": 0}
    for attempt in range(kills + 1):
        resume = None
        if checkpoint.exists():
            try:
                verify(checkpoint)
                resume = checkpoint
            except ConfigError as err:
                report["corrupt"] += 1
                report.setdefault("corrupt_why", []).append(str(err))
        if resume is not None:
            report["resumed"] += 1
            # the steps the checkpoint holds are the tasks that count; a step recorded after it is redone
            kept = recorded_steps(resume)
            log = out / "tasks.jsonl"
            log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:kept]))
        elif attempt > 0:
            report["restarts"] += 1
            shutil.rmtree(out, ignore_errors=True)
        seen = phase_count(out)
        proc = start(out, steps, algorithm, resume)
        if attempt < kills:
            while proc.poll() is None and phase_count(out) == seen:  # its start-up: imports, models
                time.sleep(0.02)
            deadline = time.perf_counter() + rng.uniform(0.0, 1.0) * duration
            while proc.poll() is None and time.perf_counter() < deadline:
                time.sleep(0.01)
            if proc.poll() is None:
                report["kills"].append(last_phase(out) if out.exists() else "start-up")
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                continue
        _, err = proc.communicate()
        if proc.returncode != 0:
            report["error"] = err.decode()[-500:]
            return report, None, None
        break
    tasks = (out / "tasks.jsonl").read_text().splitlines()
    return report, tasks, torch.load(out / "params.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=6, help="trials per algorithm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kills", type=int, default=2, help="kills per trial (at most)")
    parser.add_argument("--algorithms", nargs="+", default=["magrpo", "iac"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="lit_marl_soak-"))
    totals = collections.Counter()
    phases = collections.Counter()
    worst = 0.0
    try:
        for algorithm in args.algorithms:
            ref_tasks, ref_params, duration = reference(root, args.steps, algorithm)
            for index in range(args.trials):
                report, tasks, params = trial(root, index, args.steps, algorithm, args.kills, duration, rng)
                phases.update(report["kills"])
                totals["trials"] += 1
                totals["kills"] += len(report["kills"])
                totals["resumed"] += report["resumed"]
                totals["restarts"] += report["restarts"]
                totals["corrupt"] += report["corrupt"]
                if tasks is None:
                    totals["failed"] += 1
                else:
                    lost = sum((collections.Counter(ref_tasks) - collections.Counter(tasks)).values())
                    repeated = sum((collections.Counter(tasks) - collections.Counter(ref_tasks)).values())
                    order_ok = tasks == ref_tasks
                    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
                    worst = max(worst, diff)
                    totals["lost"] += lost
                    totals["repeated"] += repeated
                    totals["order_differs"] += not order_ok
                    report.update(lost=lost, repeated=repeated, same_order=order_ok, max_param_diff=diff)
                print(json.dumps(report), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print("| what | count |")
    print("|---|---|")
    print(f"| trials ({', '.join(args.algorithms)}; {args.steps} steps each) | {totals['trials']} |")
    print(f"| kills (SIGKILL at a random moment) | {totals['kills']} |")
    for name, count in sorted(phases.items()):
        print(f"| - during {name} | {count} |")
    print(f"| runs resumed from a checkpoint | {totals['resumed']} |")
    print(f"| runs restarted (killed before the first checkpoint) | {totals['restarts']} |")
    print(f"| checkpoints corrupt | {totals['corrupt']} |")
    print(f"| runs that failed | {totals['failed']} |")
    print(f"| tasks lost / repeated | {totals['lost']} / {totals['repeated']} |")
    print(f"| trials whose task order differs | {totals['order_differs']} |")
    print(f"| largest parameter difference from the uninterrupted run | {worst:.2e} |")


if __name__ == "__main__":
    main()
