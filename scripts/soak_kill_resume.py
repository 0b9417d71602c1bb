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

Several processes (``--fsdp``: 2 ranks, per-layer FSDP unless another mode is named; ``--engine vllm``:
vLLM rollouts, the runs under .venv-vllm's python unless ``--python`` names another):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/soak_kill_resume.py --algorithms magrpo --engine vllm --fsdp

Every run starts in a session of its own and a kill is SIGKILL to its whole process group (both
ranks at once, as when a machine dies); after each kill and each run's end the soak checks that no
process of the run is left (``/proc``: its session, or its output folder on the command line), and
kills and counts what is. A sharded checkpoint (a folder) is verified by reading its ``.metadata``,
checking that every shard file it names holds its bytes and loading ``meta.pt``; a kill between the
two renames that swap one in leaves ``last.ckpt.old`` alone, and the run resumes from that.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from lit_marl import ConfigError
from lit_marl.checkpoint_files import verify

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "scripts" / "resume_run.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@dataclass
class Runs:
    """How the soak starts its runs: ``python`` runs ``resume_run.py`` with ``flags`` (``--fsdp MODE``,
    ``--engine vllm``); each run's stderr goes to ``logs``; ``leftover``: processes found running
    after a kill or a run's end (each killed then)."""

    steps: int
    python: str
    flags: list[str]
    logs: Path
    leftover: list[str] = field(default_factory=list)

    def start(self, out: Path, algorithm: str, resume: Path | None) -> subprocess.Popen:
        command = [self.python, str(RUN), str(out), "--steps", str(self.steps), "--algorithm", algorithm, *self.flags]
        if resume is not None:
            command += ["--resume", str(resume)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.logs.mkdir(parents=True, exist_ok=True)
        # a file, not a pipe: vLLM and a second rank write more than a pipe holds before anyone reads it
        with open(self.logs / f"{out.name}.log", "ab") as log:
            # a session of its own: a kill reaches every process of the run (ranks, engines)
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)

    def error(self, out: Path) -> str:
        return (self.logs / f"{out.name}.log").read_text(errors="replace")[-2000:]

    def kill(self, proc: subprocess.Popen, out: Path) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        self.reap(proc, out)

    def reap(self, proc: subprocess.Popen, out: Path) -> None:
        """After ``proc`` ended: every process of its run gone within 10 s, else counted and killed."""
        deadline = time.monotonic() + 10.0
        while (left := run_processes(proc.pid, out)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid, command in left:
            self.leftover.append(f"{pid} {command}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_processes(session: int, out: Path) -> list[tuple[int, str]]:
    """Live processes (not zombies) of a run: in its session, or with its output folder in their command."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        state, _, _, sid = stat[stat.rindex(")") + 2 :].split()[:4]
        if state != "Z" and (int(sid) == session or str(out) in command.split()):
            found.append((int(entry.name), command[:160]))
    return found


def last_phase(out: Path) -> str:
    log = out / "phases.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return lines[-1].split()[0] if lines else "start-up"


def checked(checkpoint: Path) -> None:
    """``verify``; a sharded checkpoint (a folder), which ``verify`` only sees exists: its ``.metadata``
    reads, every shard file it names holds its bytes, and ``meta.pt`` loads. ``ConfigError`` if not."""
    verify(checkpoint)
    if not checkpoint.is_dir():
        return
    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
        torch.load(checkpoint / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(f"{checkpoint}: {type(err).__name__}: {str(err)[:200]}") from None
    sizes = collections.Counter()
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes[info.relative_path], info.offset + info.length)
    for name, size in sizes.items():
        shard = checkpoint / name
        if not shard.is_file() or shard.stat().st_size < size:
            raise ConfigError(f"{checkpoint}: shard file {name} missing or short of its {size} bytes")


def resumable(out: Path) -> Path | None:
    """``last.ckpt``; or ``last.ckpt.old`` when a kill fell between the two renames of a sharded one."""
    checkpoint = out / "checkpoints" / "last.ckpt"
    old = checkpoint.with_name("last.ckpt.old")
    if not checkpoint.exists() and old.is_dir():
        return old
    return checkpoint if checkpoint.exists() else None


def recorded_steps(checkpoint: Path) -> int:
    path = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint  # sharded: the non-tensor part
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=not checkpoint.is_dir())
    return next(v["steps"] for k, v in state["callbacks"].items() if k.startswith("Recorder"))


def phase_count(out: Path) -> int:
    log = out / "phases.log"
    return len(log.read_text().splitlines()) if log.is_file() else 0


def task_logs(out: Path) -> dict[str, list[str]]:
    """Each rank's task log (tasks.jsonl, tasks_rank1.jsonl, ...): its lines."""
    return {log.name: log.read_text().splitlines() for log in sorted(out.glob("tasks*.jsonl"))}


def reference(runs: Runs, root: Path, algorithm: str) -> tuple[dict[str, list[str]], dict, float]:
    """The uninterrupted run: its tasks, parameters and the seconds of its training (from its
    first rollout to its end; the start-up before it is not where the kills should fall)."""
    out = root / f"reference_{algorithm}"
    started = time.perf_counter()
    proc = runs.start(out, algorithm, None)
    while proc.poll() is None and phase_count(out) == 0:
        time.sleep(0.02)
    began = time.perf_counter()
    proc.wait()
    runs.reap(proc, out)
    if proc.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{runs.error(out)}")
    ended = time.perf_counter()
    print(f"reference {algorithm}: {ended - started:.0f} s, {ended - began:.0f} s of training", file=sys.stderr)
    return task_logs(out), torch.load(out / "params.pt"), ended - began


def prepare(out: Path, attempt: int, report: dict) -> Path | None:
    """Before a trial's attempt: the checkpoint to resume from (verified; the task logs cut to the
    steps it holds), or None to start afresh (the run's folder emptied if it was killed before)."""
    resume = resumable(out)
    if resume is not None:
        try:
            checked(resume)
        except ConfigError as err:
            report["corrupt"] += 1
            report.setdefault("corrupt_why", []).append(str(err))
            resume = None
    if resume is not None:
        report["resumed"] += 1
        if resume.name.endswith(".old"):
            report["from_old"] = report.get("from_old", 0) + 1
        # the steps the checkpoint holds are the tasks that count; a step recorded after it is redone
        kept = recorded_steps(resume)
        for log in out.glob("tasks*.jsonl"):
            log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:kept]))
    elif attempt > 0:
        report["restarts"] += 1
        shutil.rmtree(out, ignore_errors=True)
    return resume


def trial(runs: Runs, root: Path, index: int, algorithm: str, kills: int, duration: float, rng: random.Random):
    out = root / f"trial_{algorithm}_{index}"
    report = {"algorithm": algorithm, "trial": index, "kills": [], "resumed": 0, "corrupt": 0, "restarts": 0}
    for attempt in range(kills + 1):
        resume = prepare(out, attempt, report)
        seen = phase_count(out)
        proc = runs.start(out, algorithm, resume)
        if attempt < kills:
            while proc.poll() is None and phase_count(out) == seen:  # its start-up: imports, models
                time.sleep(0.02)
            deadline = time.perf_counter() + rng.uniform(0.0, 1.0) * duration
            while proc.poll() is None and time.perf_counter() < deadline:
                time.sleep(0.01)
            if proc.poll() is None:
                report["kills"].append(last_phase(out) if out.exists() else "start-up")
                runs.kill(proc, out)
                continue
        proc.wait()
        runs.reap(proc, out)
        if proc.returncode != 0:
            report["error"] = runs.error(out)[-500:]
            return report, None, None
        break
    return report, task_logs(out), torch.load(out / "params.pt")


def compare(report: dict, tasks: dict[str, list[str]], params: dict, ref_tasks: dict, ref_params: dict) -> None:
    """Adds to ``report`` the tasks lost and repeated (over every rank's log), whether the order is
    the reference's, and the largest parameter difference."""
    lost = repeated = 0
    for name in ref_tasks.keys() | tasks.keys():
        ours, theirs = collections.Counter(tasks.get(name, [])), collections.Counter(ref_tasks.get(name, []))
        lost += sum((theirs - ours).values())
        repeated += sum((ours - theirs).values())
    diff = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
    report.update(lost=lost, repeated=repeated, same_order=tasks == ref_tasks, max_param_diff=diff)


def child_python(args: argparse.Namespace) -> str:
    """``--python``, else this interpreter, else (vLLM runs, vLLM not installed here) .venv-vllm's."""
    if args.python:
        return args.python
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None and VLLM_PYTHON.exists():
        return str(VLLM_PYTHON)
    return sys.executable


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=6, help="trials per algorithm")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kills", type=int, default=2, help="kills per trial (at most)")
    parser.add_argument("--algorithms", nargs="+", default=["magrpo", "iac"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm"], help="the runs' data.engine")
    parser.add_argument(
        "--fsdp",
        nargs="?",
        const="per_layer",
        choices=["gathered", "per_layer", "auto"],
        help="2 ranks under TeamFSDPStrategy(mode=...): per_layer when no mode is given",
    )
    parser.add_argument("--python", help="the interpreter of the runs (default: this one; for vllm .venv-vllm's)")
    return parser.parse_args()


def table(args: argparse.Namespace, totals: collections.Counter, phases: collections.Counter, worst: float, runs):
    setup = f", FSDP {args.fsdp} on 2 ranks" if args.fsdp else ""
    setup += f", engine {args.engine}" if args.engine != "auto" else ""
    print()
    print("| what | count |")
    print("|---|---|")
    print(f"| trials ({', '.join(args.algorithms)}; {args.steps} steps each{setup}) | {totals['trials']} |")
    print(f"| kills (SIGKILL at a random moment) | {totals['kills']} |")
    for name, count in sorted(phases.items()):
        print(f"| - during {name} | {count} |")
    print(f"| runs resumed from a checkpoint | {totals['resumed']} |")
    if totals["from_old"]:
        print(
            f"| - of which from last.ckpt.old (killed between a sharded checkpoint's renames) | {totals['from_old']} |"
        )
    print(f"| runs restarted (killed before the first checkpoint) | {totals['restarts']} |")
    print(f"| checkpoints corrupt | {totals['corrupt']} |")
    print(f"| runs that failed | {totals['failed']} |")
    print(f"| tasks lost / repeated | {totals['lost']} / {totals['repeated']} |")
    print(f"| trials whose task order differs | {totals['order_differs']} |")
    print(f"| largest parameter difference from the uninterrupted run | {worst:.2e} |")
    if args.fsdp or args.engine != "auto" or runs.leftover:
        print(f"| processes left running after a kill or a run's end | {len(runs.leftover)} |")


def main() -> None:
    args = parse()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="lit_marl_soak-"))
    flags = (["--fsdp", args.fsdp] if args.fsdp else []) + (["--engine", args.engine] if args.engine != "auto" else [])
    runs = Runs(args.steps, child_python(args), flags, root / "logs")
    totals = collections.Counter()
    phases = collections.Counter()
    worst = 0.0
    try:
        for algorithm in args.algorithms:
            ref_tasks, ref_params, duration = reference(runs, root, algorithm)
            for index in range(args.trials):
                report, tasks, params = trial(runs, root, index, algorithm, args.kills, duration, rng)
                phases.update(report["kills"])
                totals["trials"] += 1
                totals["kills"] += len(report["kills"])
                for key in ("resumed", "restarts", "corrupt", "from_old"):
                    totals[key] += report.get(key, 0)
                if tasks is None:
                    totals["failed"] += 1
                else:
                    compare(report, tasks, params, ref_tasks, ref_params)
                    worst = max(worst, report["max_param_diff"])
                    totals["lost"] += report["lost"]
                    totals["repeated"] += report["repeated"]
                    totals["order_differs"] += not report["same_order"]
                print(json.dumps(report), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in runs.leftover:
        print(f"left running (killed): {line}", file=sys.stderr)
    table(args, totals, phases, worst, runs)


if __name__ == "__main__":
    main()
