"""Turn-level credit compared: trajectory-level GRPO, step-level GRPO (GiGPO's anchor groups), RLOO
and PPO on the same held-out games, from the same start, with the same episodes, per episode budget.

    python scripts/credit_comparison.py --env textworld --algorithms grpo grpo_step rloo ppo \\
        --seeds 0 1 --episodes 24 --eval-every 24 --out results/credit_textworld

First (once per output folder) the start: SmolLM2 fine-tuned on ``--sft-demos`` walkthroughs of
validation-seed games (``--sft-demos 0``: the base model), exported as a plain HF folder and
evaluated greedily on the held-out test-seed games (the "0 episodes" point of every curve). Then a
cell per algorithm x seed: ``configs/<env>/grpo_cpu.yaml`` (GRPO, RLOO and the step-level variant,
``model.advantage.step_weight``) or ``ppo_cpu.yaml`` with the start as its model, fresh LoRA
adapters, ``--episodes-per-step`` episodes a step (G = ``--group-size`` per task for the group
methods, one per task for PPO), evaluated greedily on the held-out games every ``--eval-every``
episodes. Every run's config is written under ``<out>/cells/<cell>/config.yaml`` (rerun with
``lit-marl fit --config``). Rows go to ``<out>/results.jsonl`` (a killed comparison resumes at the
cell it was in); ``<out>/results.md`` is the table (held-out success per budget, mean +- std over
seeds) and ``<out>/success.svg`` the curves. ``--set key=value`` overrides any cell's config entry.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("textworld_ablation", REPO / "scripts" / "textworld_ablation.py")
ablation = importlib.util.module_from_spec(_spec)  # its cell building and held-out evaluation, shared
_spec.loader.exec_module(ablation)
ALGORITHMS = ("grpo", "grpo_step", "rloo", "ppo")
GAMES = {  # env -> (train set, held-out set, demonstration set) by split, sized by the arguments
    "textworld": ("textworld:{c}:train:{n}", "textworld:{c}:test:{m}", "textworld:{c}:validation:{d}"),
    "alfworld": ("alfworld:train:{n}", "alfworld:test:{m}", "alfworld:validation:{d}"),
}


def settings_key(args) -> str:
    """A short hash of what every cell shares (a rerun with other settings is other cells)."""
    shared = [args.env, args.complexity, args.sft_demos, args.sft_epochs, args.train_games, args.eval_games,
              args.episodes_per_step, args.group_size, args.step_weight, args.set]  # fmt: skip
    if args.sft_learning_rate != 1e-3:  # (added later: the default keeps the earlier runs' folders)
        shared.append(args.sft_learning_rate)
    return hashlib.sha256(json.dumps(shared, default=str).encode()).hexdigest()[:6]


def sources(args) -> tuple[str, str, str]:
    train, held_out, demos = GAMES[args.env]
    sizes = dict(c=args.complexity, n=args.train_games, m=args.eval_games, d=args.sft_demos)
    return train.format(**sizes), held_out.format(**sizes), demos.format(**sizes)


def base_config(args, algorithm: str, seed: int, out: Path) -> dict:
    """The env's shipped config of the algorithm family with this comparison's data and logger."""
    family = "ppo" if algorithm in ("ppo", "sft") else "grpo"
    config = yaml.safe_load((REPO / "configs" / args.env / f"{family}_cpu.yaml").read_text())
    train, held_out, _ = sources(args)
    data = config["data"]["init_args"]
    group = 1 if algorithm in ("ppo", "sft") else args.group_size
    if args.episodes_per_step % group:
        raise SystemExit(f"--episodes-per-step {args.episodes_per_step} is not a multiple of --group-size {group}")
    data.update(
        train_path=train, val_path=held_out, num_generations=group, tasks_per_step=args.episodes_per_step // group
    )
    model = config["model"]
    if algorithm in ("grpo_step", "rloo"):
        model["class_path"] = "lit_marl.algorithms.RLOO" if algorithm == "rloo" else "lit_marl.algorithms.GRPO"
    if algorithm == "grpo_step":
        model["init_args"].setdefault("advantage", {})["step_weight"] = args.step_weight
    trainer = config["trainer"]
    trainer.update(max_epochs=-1, limit_train_batches=None, limit_val_batches=0, check_val_every_n_epoch=None)
    trainer["callbacks"] = []
    trainer["logger"] = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out)}}
    config["seed_everything"] = seed
    for item in args.set:
        key, _, value = item.partition("=")
        ablation.set_path(config, key, yaml.safe_load(value))
    return config


def start_model(args, out: Path) -> tuple[str, dict]:
    """The comparison's start: the SFT'd model's folder (trained once) and its held-out row."""
    folder, row_file = out / "model", out / "row.json"
    if row_file.exists():
        return json.loads(row_file.read_text())["model"], json.loads(row_file.read_text())
    config = base_config(args, "sft", 0, out)
    model_source = config["model"]["init_args"]["model"]
    if args.sft_demos:
        _, _, demos = sources(args)
        config["data"]["init_args"]["demos"] = {"path": demos, "batch_size": 4}
        config["model"] = {
            "class_path": "lit_marl.algorithms.SFT",
            "init_args": {k: v for k, v in config["model"]["init_args"].items() if k in ("model", "lora")}
            | {"learning_rate": args.sft_learning_rate},
        }
        config["trainer"].update(max_epochs=args.sft_epochs)  # an epoch: every demonstration once
        config["trainer"]["callbacks"] = [
            {"class_path": "lit_marl.callbacks.HFExport", "init_args": {"dirpath": str(folder), "lora": "merged"}}
        ]
    start = time.perf_counter()
    if args.sft_demos:
        cli = ablation.build(config, out)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        (model_source,) = [str(p) for p in folder.iterdir() if p.is_dir()]
    train_s = round(time.perf_counter() - start, 1)
    evaluation = base_config(args, "grpo", 0, out / "evaluation")  # the start as every cell loads it
    evaluation["model"]["init_args"]["model"] = model_source
    cli = ablation.build(evaluation, out / "evaluation")
    cli.model.configure_model()
    row = {"model": model_source, "demos": args.sft_demos, "sft_epochs": args.sft_epochs, "train_s": train_s}
    row |= ablation.held_out(cli.model, cli.datamodule)
    row_file.write_text(json.dumps(row))
    return model_source, row


def run_cell(args, algorithm: str, seed: int, model: str, out: Path) -> list[dict]:
    """One algorithm x seed from the start, evaluated every ``--eval-every`` episodes."""
    import lightning as L

    config = base_config(args, algorithm, seed, out)
    config["model"]["init_args"]["model"] = model
    steps = args.episodes // args.episodes_per_step
    every = max(args.eval_every // args.episodes_per_step, 1)
    # Every stops the run after `steps` training steps (not max_steps: a PPO step is several optimizer steps)
    cli = ablation.build(config, out)
    rows: list[dict] = []

    class Every(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.start, self.train_s = time.perf_counter(), 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = pl_module.training_steps
            if step % every and step != steps:
                return
            self.train_s += time.perf_counter() - self.start
            row = {"episodes": step * args.episodes_per_step, "train_s": round(self.train_s, 1)}
            rows.append(row | ablation.held_out(pl_module, trainer.datamodule))
            print(
                f"[credit] {algorithm} seed {seed}: {row['episodes']} episodes -> won {rows[-1]['won']:.3f}", flush=True
            )
            self.start = time.perf_counter()
            trainer.should_stop = step >= steps

    cli.trainer.callbacks.append(Every())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return [row | training_metrics(out, row["episodes"] // args.episodes_per_step) for row in rows]


def training_metrics(out: Path, steps: int) -> dict:
    """The training means over the run's first ``steps`` training steps (one logged row each) from
    its CSV log: reward, wins, and the anchor groups' share."""
    import csv

    files = sorted(out.glob("lightning_logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not files:
        return {}
    with open(files[-1]) as handle:
        table = list(csv.DictReader(handle))
    means = {}
    for key in ("train/reward", "train/won", "train/anchor_grouped_frac", "train/anchor_group_size"):
        values = [float(r[key]) for r in table if r.get(key) not in (None, "")][:steps]
        if values:
            means[key.replace("/", "_")] = round(statistics.fmean(values), 4)  # never the held-out "won"
    return means


# ---------------------------------------------------------------------------- the table and the plot
def summarize(rows: list[dict], start: dict) -> dict[str, dict[int, list[float]]]:
    """Per algorithm, per episode budget: the held-out success of each seed (0 episodes: the start)."""
    curves: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        curve = curves.setdefault(row["algorithm"], {0: [start["won"]]})
        curve.setdefault(row["episodes"], []).append(row["won"])
    return curves


def table(curves: dict, rows: list[dict], start: dict) -> str:
    budgets = sorted({b for c in curves.values() for b in c})
    head = "| algorithm | " + " | ".join(f"{b} episodes" for b in budgets) + " | seeds | grouped steps | train s |\n"
    head += "|---" * (len(budgets) + 4) + "|\n"
    lines = []
    for algorithm, curve in curves.items():
        mine = [r for r in rows if r["algorithm"] == algorithm]
        cells = []
        for b in budgets:
            won = curve.get(b, [])
            spread = f" ± {statistics.stdev(won):.3f}" if len(won) > 1 else ""
            cells.append(f"{statistics.fmean(won):.3f}{spread}" if won else "-")
        grouped = [r["train_anchor_grouped_frac"] for r in mine if "train_anchor_grouped_frac" in r]
        seeds = len({r["seed"] for r in mine})
        train_s = statistics.fmean(r["train_s"] for r in mine if r["episodes"] == max(curve))
        share = f"{statistics.fmean(grouped):.2f}" if grouped else "-"
        lines.append(f"| {algorithm} | {' | '.join(cells)} | {seeds} | {share} | {train_s:.0f} |\n")
    note = (
        f"\nHeld-out greedy success on {start['eval_episodes']} test-seed games, mean ± std over seeds; 0 episodes: "
        f"the start ({start['demos']} demonstrations, on ALFWorld per task type, x {start['sft_epochs']} epochs of "
        "SFT), shared by every "
        "algorithm. Grouped steps: the share of training steps whose anchor state another episode of the task "
        "also reached (step-level GRPO only). Train s: training seconds to the last budget (evaluation excluded). "
        "Each algorithm keeps its shipped config: PPO makes 2 passes over a step's episodes with a value head and "
        "plays one episode per task (so it sees G times as many distinct training games as the group methods); "
        "GRPO and step-level GRPO scale by the group's std, RLOO does not.\n"
    )
    return head + "".join(lines) + paired(rows) + note


def paired(rows: list[dict], reference: str = "grpo") -> str:
    """Each algorithm minus trajectory-level GRPO on the same seeds (same start, same seed): the
    difference per seed at the last budget both reached, so seed-to-seed noise shared by the two cancels."""
    won = {(r["algorithm"], r["seed"], r["episodes"]): r["won"] for r in rows}
    out = []
    for algorithm in sorted({r["algorithm"] for r in rows} - {reference}):
        diffs = []
        for seed in sorted({r["seed"] for r in rows}):
            common = [e for (a, s, e) in won if a == algorithm and s == seed and (reference, seed, e) in won]
            if common:
                e = max(common)
                diffs.append((seed, e, won[algorithm, seed, e] - won[reference, seed, e]))
        if diffs:
            values = [d for _, _, d in diffs]
            spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            each = ", ".join(f"seed {seed}: {d:+.3f} at {e}" for seed, e, d in diffs)
            out.append(f"- {algorithm} − {reference}: {statistics.fmean(values):+.3f}{spread} ({each})\n")
    return "\nPaired differences (same seed, last common budget):\n" + "".join(out) if out else ""


def svg(curves: dict) -> str:
    """Success against episodes, a line per algorithm (the mean over seeds, whiskers: the std)."""
    width, height, left, bottom, top = 520, 320, 60, 260, 40
    budgets = sorted({b for c in curves.values() for b in c}) or [0]
    span = max(budgets[-1], 1)
    x = lambda b: left + (b / span) * (width - left - 130)  # noqa: E731
    y = lambda v: bottom - v * (bottom - top)  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="{left}" y="20" font-size="14">Held-out success (greedy) per training episodes</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{x(span)}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<text x="{left - 8}" y="{y(tick) + 4:.0f}" text-anchor="end">{tick:.2f}</text>')
        parts.append(f'<line x1="{left}" y1="{y(tick):.0f}" x2="{x(span):.0f}" y2="{y(tick):.0f}" stroke="#ddd"/>')
    for b in budgets:
        parts.append(f'<text x="{x(b):.0f}" y="{bottom + 16}" text-anchor="middle">{b}</text>')
    parts.append(f'<text x="{(left + x(span)) / 2:.0f}" y="{bottom + 34}" text-anchor="middle">episodes</text>')
    palette = {"grpo": "#ff7f0e", "grpo_step": "#d62728", "rloo": "#2ca02c", "ppo": "#1f77b4"}
    for i, (algorithm, curve) in enumerate(sorted(curves.items())):
        colour = palette.get(algorithm, "#9467bd")
        points = [
            (b, statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0) for b, v in sorted(curve.items())
        ]
        path = " ".join(f"{x(b):.1f},{y(m):.1f}" for b, m, _ in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for b, m, s in points:
            parts.append(f'<circle cx="{x(b):.1f}" cy="{y(m):.1f}" r="3" fill="{colour}"/>')
            if s:
                lo, hi = y(max(m - s, 0)), y(min(m + s, 1))
                parts.append(f'<line x1="{x(b):.1f}" y1="{lo:.1f}" x2="{x(b):.1f}" y2="{hi:.1f}" stroke="{colour}"/>')
        parts.append(f'<text x="{x(span) + 12:.0f}" y="{top + 16 * i + 4}" fill="{colour}">{algorithm}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_reports(out: Path, rows: list[dict], start: dict) -> None:
    curves = summarize(rows, start)
    (out / "results.md").write_text("# Turn-level credit: held-out greedy success\n\n" + table(curves, rows, start))
    (out / "success.svg").write_text(svg(curves))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="textworld", choices=sorted(GAMES))
    parser.add_argument("--complexity", default="w2-o3-q4", help="TextWorld's game complexity")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--episodes", type=int, default=24, help="training episodes per cell")
    parser.add_argument("--eval-every", type=int, default=24, help="evaluate every n training episodes")
    parser.add_argument("--episodes-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="G of the group methods")
    parser.add_argument("--step-weight", type=float, default=1.0, help="grpo_step's model.advantage.step_weight")
    parser.add_argument(
        "--sft-demos",
        type=int,
        default=60,
        help="walkthroughs of the start's SFT (ALFWorld: per task type; 0: the base model)",
    )
    parser.add_argument("--sft-epochs", type=int, default=4)
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3)
    parser.add_argument("--train-games", type=int, default=64, help="TextWorld: games; ALFWorld: per task type")
    parser.add_argument("--eval-games", type=int, default=16, help="TextWorld: games; ALFWorld: per task type")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (dotted keys)")
    parser.add_argument("--out", type=Path, default=Path("results/credit"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.episodes % args.episodes_per_step or args.eval_every % args.episodes_per_step:
        raise SystemExit("--episodes and --eval-every must be multiples of --episodes-per-step")
    settings = settings_key(args)
    root = args.out / settings
    root.mkdir(parents=True, exist_ok=True)
    model, start = start_model(args, root / "start")
    print(f"[credit] start {model}: won {start['won']:.3f} of {start['eval_episodes']}", flush=True)
    results = args.out / "results.jsonl"
    done = {row["cell"] for row in ablation.load_rows(results)}
    for seed in args.seeds:  # every algorithm of a seed first: a cut-short comparison still compares
        for algorithm in args.algorithms:
            name = f"{algorithm}-s{seed}-e{args.episodes}-every{args.eval_every}-{settings}"
            if name in done:
                print(f"[credit] {name}: done before, kept", flush=True)
                continue
            print(f"[credit] {name} ...", flush=True)
            rows = run_cell(args, algorithm, seed, model, root / "cells" / name)
            with open(results, "a") as f:
                for row in rows:
                    f.write(json.dumps({"cell": name, "algorithm": algorithm, "seed": seed, **row}) + "\n")
            write_reports(args.out, [r for r in ablation.load_rows(results) if r["cell"].endswith(settings)], start)
    write_reports(args.out, [r for r in ablation.load_rows(results) if r["cell"].endswith(settings)], start)
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
