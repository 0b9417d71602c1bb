"""The quickstart (MAGRPO, slogan task, SmolLM2) on vLLM servers, on-policy (``data.max_staleness: 0``)
against rollouts generated during the update (``1``), over seeds: does learning from one-update-old rows,
weighed by the truncated importance ratio, learn as well?

    make vllm
    .venv-vllm/bin/python scripts/overlap_curves.py --seeds 0 1 2 --out docs/findings/overlap_quickstart

Each cell is ``lit-marl fit --config configs/quickstart.yaml`` with ``data.engine: vllm_server`` (the run
starts one CPU server per agent's model), ``model.update.rollout_is_cap: 2.0`` in both settings, and its
seed; the settings alternate within a seed. A finished cell is a row of ``results.jsonl`` and is not run
again; ``results.md`` is written after each: per cell the held-out success and reward before and after
training (the quickstart's HeldOutEvaluation), the training reward's mean over the last 10 steps, the
mean staleness and the training time; per setting the mean ± std over seeds; and curves.png, each
setting's curves averaged over its seeds (``lit-marl plot --average``). Budgets are in steps (the
config's 30), never wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER = "{server_args: {max_model_len: 1024, max_num_seqs: 64}, timeout_s: 900}"


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(folder.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_cell(out: Path, seed: int, staleness: int) -> dict:
    name = f"s{staleness}-seed{seed}"
    folder = out / "cells" / name
    shutil.rmtree(folder, ignore_errors=True)  # a cell without a results row never finished
    command = [str(Path(sys.executable).parent / "lit-marl"), "fit", "--config", "configs/quickstart.yaml"]
    command += ["--seed_everything", str(seed), "--trainer.logger.init_args.save_dir", str(folder)]
    command += ["--data.init_args.engine", "vllm_server", "--data.init_args.engine_options", SERVER]
    command += ["--data.init_args.max_staleness", str(staleness), "--model.init_args.update.rollout_is_cap", "2.0"]
    started = time.perf_counter()
    folder.mkdir(parents=True)
    with open(folder / "output.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=log, stderr=log)
    if done.returncode:
        raise SystemExit(f"{name} failed: see {folder / 'output.log'}")
    values = scalars(folder)
    reward = [v for _, v in values["train/reward"]]
    staleness_seen = [v for _, v in values.get("train/staleness", [])]
    row = {
        "cell": name,
        "max_staleness": staleness,
        "seed": seed,
        "steps": len(reward),
        "success_before": values["eval/success"][0][1],
        "success_after": values["eval/success"][-1][1],
        "heldout_reward_before": values["eval/reward"][0][1],
        "heldout_reward_after": values["eval/reward"][-1][1],
        "train_reward_last10": statistics.mean(reward[-10:]),
        "mean_staleness": statistics.mean(staleness_seen) if staleness_seen else 0.0,
        "seconds": round(time.perf_counter() - started, 1),
        "command": " ".join(command[1:]),
    }
    return row


def table(rows: list[dict]) -> str:
    lines = ["# The quickstart on vLLM servers: on-policy against one step off-policy", ""]
    lines += ["| max_staleness | seed | steps | held-out success before → after | held-out reward before → after |"]
    lines[-1] += " train reward (last 10 steps) | mean staleness | whole run s |"
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["max_staleness"], r["seed"])):
        lines.append(
            f"| {r['max_staleness']} | {r['seed']} | {r['steps']} "
            f"| {r['success_before']:.3f} → {r['success_after']:.3f} "
            f"| {r['heldout_reward_before']:.3f} → {r['heldout_reward_after']:.3f} | {r['train_reward_last10']:.3f} "
            f"| {r['mean_staleness']:.2f} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "| max_staleness | seeds | held-out success after (mean ± std) | train reward, last 10 (mean ± std) |",
    ]
    lines += ["|---|---|---|---|"]
    for staleness in sorted({r["max_staleness"] for r in rows}):
        mine = [r for r in rows if r["max_staleness"] == staleness]
        spread = [
            f"{statistics.mean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.3f}"
            for v in ([r["success_after"] for r in mine], [r["train_reward_last10"] for r in mine])
        ]
        lines.append(f"| {staleness} | {len(mine)} | {spread[0]} | {spread[1]} |")
    lines += ["", "Each cell's command is in results.jsonl; its TensorBoard logs and output are under cells/."]
    return "\n".join(lines) + "\n"


def figure(out: Path) -> None:
    """curves.png: each setting's training reward, held-out success and staleness per step, the mean over
    its seeds with the band from the lowest to the highest (``lit-marl plot --average``)."""
    from lit_marl import ConfigError
    from lit_marl.plots import plot

    tags = ["train/reward", "eval/success", "train/staleness"]
    cells = out / "cells"
    cells = str(cells.relative_to(Path.cwd()) if cells.is_relative_to(Path.cwd()) else cells)  # the figure's title
    try:
        plot([cells], out / "curves.png", tags, average="-seed[0-9]+")
    except ConfigError:  # one cell per setting so far: nothing to average
        plot([cells], out / "curves.png", tags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="docs/findings/overlap_quickstart")
    args = parser.parse_args()
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    done = {r["cell"] for r in rows}
    for seed in args.seeds:
        for staleness in (0, 1):
            if f"s{staleness}-seed{seed}" in done:
                continue
            row = run_cell(out, seed, staleness)
            rows.append(row)
            with open(results, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            (out / "results.md").write_text(table(rows))
            figure(out)
            print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)


if __name__ == "__main__":
    main()
