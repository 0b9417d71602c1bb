"""The turn-level credit comparison script: its reports from rows (fast), and end to end on a tiny
model (make test-slow): the start is trained once and shared, every cell is evaluated at each
budget, the step-level cell records its anchor groups, and a rerun resumes instead of redoing."""

from __future__ import annotations

import importlib.util
import json
import xml.etree.ElementTree as ET

import pytest
import yaml

from helpers import REPO_ROOT

spec = importlib.util.spec_from_file_location("credit_comparison", REPO_ROOT / "scripts" / "credit_comparison.py")
credit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(credit)

START = {"won": 0.25, "eval_episodes": 4, "demos": 2, "sft_epochs": 1}


def test_the_table_and_the_curves_from_rows():
    rows = [
        {"algorithm": "grpo", "seed": 0, "episodes": 8, "won": 0.5, "train_s": 10.0},
        {"algorithm": "grpo", "seed": 1, "episodes": 8, "won": 0.0, "train_s": 12.0},
        {
            "algorithm": "grpo_step",
            "seed": 0,
            "episodes": 8,
            "won": 0.75,
            "train_s": 11.0,
            "train_anchor_grouped_frac": 0.4,
        },
    ]
    curves = credit.summarize(rows, START)
    assert curves == {"grpo": {0: [0.25], 8: [0.5, 0.0]}, "grpo_step": {0: [0.25], 8: [0.75]}}
    text = credit.table(curves, rows, START)
    assert "| grpo | 0.250 | 0.250 ± 0.354 | 2 | - | 11 |" in text
    assert "| grpo_step | 0.250 | 0.750 | 1 | 0.40 | 11 |" in text
    assert "- grpo_step − grpo: +0.250 (seed 0: +0.250 at 8)" in text  # paired on seed 0 only
    ET.fromstring(credit.svg(curves))  # well-formed


@pytest.mark.slow  # a tiny SFT start and two cells on generated games (~60 s): make test-slow
def test_the_comparison_runs_every_cell_from_one_start_and_resumes(tmp_path, capsys):
    out = tmp_path / "credit"
    argv = ["--algorithms", "grpo_step", "ppo", "--seeds", "0", "--episodes", "4", "--eval-every", "2",
            "--episodes-per-step", "2", "--group-size", "2", "--sft-demos", "2", "--sft-epochs", "1",
            "--train-games", "2", "--eval-games", "2", "--out", str(out), "--set", "model.init_args.model=tiny-random",
            "model.init_args.lora=null", "data.init_args.sampling.max_new_tokens=6",
            "data.init_args.max_turns=3"]  # fmt: skip
    credit.main(argv)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["algorithm"], r["episodes"]) for r in rows] == [
        ("grpo_step", 2),
        ("grpo_step", 4),
        ("ppo", 2),
        ("ppo", 4),
    ]
    assert all(0 <= r["won"] <= 1 and r["eval_episodes"] == 2 for r in rows)
    assert rows[0]["train_anchor_grouped_frac"] > 0 and "train_anchor_grouped_frac" not in rows[2]
    assert "train_won" in rows[0]  # the training outcome never takes the held-out figure's key
    (settings,) = [p for p in out.iterdir() if p.is_dir()]
    start = json.loads((settings / "start" / "row.json").read_text())
    assert start["demos"] == 2 and start["model"].startswith(str(settings / "start" / "model"))
    config = yaml.safe_load((settings / "cells" / rows[0]["cell"] / "config.yaml").read_text())
    assert config["model"]["init_args"]["model"] == start["model"]  # every cell starts from the SFT'd model
    assert config["model"]["init_args"]["advantage"]["step_weight"] == 1.0
    ppo = yaml.safe_load((settings / "cells" / rows[2]["cell"] / "config.yaml").read_text())
    assert ppo["data"]["init_args"]["num_generations"] == 1 and ppo["data"]["init_args"]["tasks_per_step"] == 2
    assert "| grpo_step |" in (out / "results.md").read_text()
    capsys.readouterr()
    credit.main(argv)  # everything done: kept, not redone
    assert "done before, kept" in capsys.readouterr().out
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
