"""What the RL part of each finished grid cell saw: how many steps carried a learning signal.

    python scripts/rl_diagnostics.py docs/findings/alfworld [--cells GLOB]

Reads each finished cell's CSVLogger log (``<grid>/cells/<cell>/logs/version_*/metrics.csv``, written by
``scripts/textworld_ablation.py``) and prints one markdown row per cell: its RL steps, the share of
its training episodes won (sampled, not the greedy held-out figure), the steps whose advantages
were not all zero (a GRPO/RLOO step whose groups all tied has none), the updates
``model.update.skip_signalless_steps`` left out (optimizer steps: one per mini-batch and pass), the mean
PPO approx-KL between the rollout and the updated policy, the last KL to the reference
(``<agent>/kl_ref``, where a KL term ran) and, with a critic, the steps whose explained variance
was positive. These are the figures that tell why RL after SFT moved (or did not move) the
held-out success.
"""

from __future__ import annotations

import argparse
import json
import statistics
from fnmatch import fnmatchcase
from pathlib import Path

SIGNAL = 1e-6  # an advantage std at or below this: every row's advantage is zero (ties)
COLUMNS = ("cell", "RL steps", "train won", "steps with signal", "updates skipped", "approx KL", "KL to ref", "EV > 0")


def read_log(run: Path) -> dict[int, dict[str, float]]:
    """Every logged value of a run folder by step (``lit-marl plot``'s reader; a step's values may
    come on several rows of a metrics.csv)."""
    from lit_marl.plots import load_scalars

    steps: dict[int, dict[str, float]] = {}
    for tag, points in load_scalars(run)[0].items():
        for step, value in points:
            steps.setdefault(step, {})[tag] = value
    return steps


def diagnose(name: str, steps: dict[int, dict[str, float]]) -> dict[str, str]:
    """One cell's row (``COLUMNS``): its RL steps are those that logged ``train/won``."""
    rl = [values for _, values in sorted(steps.items()) if "train/won" in values]
    stds = [v["train/advantage_std"] for v in rl if "train/advantage_std" in v]
    skipped = sum(v.get("train/skipped_steps", 0.0) for v in rl)
    kls = [v["train/approx_kl"] for v in rl if "train/approx_kl" in v]
    kl_ref = [v[k] for v in rl for k in v if k.endswith("/kl_ref")]
    ev = [v[k] for v in rl for k in v if k.endswith("/explained_variance")]
    return {
        "cell": name,
        "RL steps": str(len(rl)),
        "train won": f"{statistics.fmean(v['train/won'] for v in rl):.3f}" if rl else "-",
        "steps with signal": f"{sum(s > SIGNAL for s in stds)} of {len(stds)}",
        "updates skipped": f"{skipped:g}",
        "approx KL": f"{statistics.fmean(kls):.4f}" if kls else "-",
        "KL to ref": f"{kl_ref[-1]:.4f}" if kl_ref else "-",
        "EV > 0": f"{sum(e > 0 for e in ev)} of {len(ev)}" if ev else "-",
    }


def cell_rows(grid: Path, pattern: str = "*") -> list[dict[str, str]]:
    """The rows of the grid's finished cells (those ``results.jsonl`` holds) that logged."""
    results = grid / "results.jsonl"
    finished = {json.loads(line)["cell"] for line in results.read_text().splitlines() if line.strip()}
    rows = []
    for cell in sorted((grid / "cells").iterdir()):
        logs = sorted(cell.glob("logs/version_*/metrics.csv"))
        if cell.name in finished and fnmatchcase(cell.name, pattern) and logs:
            rows.append(diagnose(cell.name, read_log(logs[-1].parent)))
    return rows


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row[c] for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", type=Path, help="a grid's folder (holding cells/)")
    parser.add_argument("--cells", default="*", help="only the cells whose names match this glob")
    args = parser.parse_args(argv)
    if not (args.grid / "cells").is_dir() or not (args.grid / "results.jsonl").is_file():
        raise SystemExit(f"rl_diagnostics: {args.grid} has no cells/ or results.jsonl: give a grid's --out folder")
    print(table(cell_rows(args.grid, args.cells)))


if __name__ == "__main__":
    main()
