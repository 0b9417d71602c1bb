"""The ablation script end to end on a tiny model: every cell trains under its budget, is evaluated
on each eval complexity, lands in the table and the plot, and a rerun resumes instead of redoing."""

from __future__ import annotations

import importlib.util
import json
import shutil
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import yaml

from helpers import REPO_ROOT

spec = importlib.util.spec_from_file_location("textworld_ablation", REPO_ROOT / "scripts" / "textworld_ablation.py")
ablation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation)

TINY = [
    "model.init_args.model=tiny-random",
    "model.init_args.lora=null",
    "data.init_args.sampling.max_new_tokens=6",
    "data.init_args.max_turns=3",
    "data.init_args.tasks_per_step=2",
]


def grid(out, capsys):
    ablation.main(
        ["--algorithms", "ppo", "--splits", "0:1", "2:2", "--budget", "4", "--train-games", "2", "--eval-games", "2",
         "--eval", "w2-o3-q4", "w8-o3-q4", "--baseline", "--out", str(out), "--set", *TINY]
    )  # fmt: skip
    return capsys.readouterr().out


@pytest.mark.slow  # every cell of the grid on generated games (~50 s): make test-slow
def test_the_grid_runs_every_cell_and_resumes(tmp_path, capsys):
    out = tmp_path / "grid"
    grid(out, capsys)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    settings = ablation.settings_key(ablation.parse_args(["--eval", "w2-o3-q4", "w8-o3-q4", "--train-games", "2",
                                                          "--eval-games", "2", "--set", *TINY]))  # fmt: skip
    cells = [
        f"base-{settings}",
        f"ppo-dense-sft0rl1-b4-w2-o3-q4-s0-{settings}",
        f"ppo-dense-sft2rl2-b4-w2-o3-q4-s0-{settings}",
    ]
    stages = [(cells[0], "base"), (cells[1], "end"), (cells[2], "after SFT"), (cells[2], "end")]
    assert [(r["cell"], r["stage"], r["eval"]) for r in rows] == [
        (c, s, e) for c, s in stages for e in ("w2-o3-q4", "w8-o3-q4")
    ]
    assert all(0.0 <= r["won"] <= 1.0 and r["eval_episodes"] == 2 for r in rows)
    rl_only, sft, sft_rl = rows[2], rows[4], rows[6]
    assert (rl_only["demos"], sft["demos"], sft_rl["demos"]) == (0, 2, 2)
    assert rl_only["train_episodes"] >= 4 and sft["train_episodes"] == 0 and sft_rl["train_episodes"] >= 2
    config = yaml.safe_load((out / "cells" / cells[2] / "config.yaml").read_text())
    assert config["data"]["init_args"]["demos"]["path"] == "textworld:w2-o3-q4:validation:2"  # not the train/test games
    assert config["trainer"]["callbacks"][0]["init_args"] == {"budget": 4.0, "split": "2:2", "demo_cost": 1.0,
                                                              "sft_epochs": 1}  # fmt: skip
    table = (out / "results.md").read_text()
    assert table.count("\n| ppo | dense |") == 6 and table.count("\n| base |") == 2
    plot = ET.fromstring((out / "success.svg").read_text())
    assert len([e for e in plot.iter() if e.tag.endswith("rect")]) == 8  # one bar per table line

    again = grid(out, capsys)
    assert again.count("done before, kept") == 3
    assert len((out / "results.jsonl").read_text().splitlines()) == 8
    other = ablation.parse_args(["--eval", "w2-o3-q4", "w8-o3-q4", "--train-games", "2", "--eval-games", "3"])
    assert ablation.settings_key(other) != settings  # other settings: other cells, never "done before"


def test_summary_spreads_over_seeds():
    rows = [
        {"algorithm": "ppo", "density": "dense", "split": "0:1", "budget": 40, "train": "w", "stage": "end",
         "eval": "w", "seed": s, "won": w, "eval_episodes": 16, "train_episodes": 40, "demos": 0, "train_s": 10.0}
        for s, w in enumerate([0.25, 0.5, 0.75])
    ]  # fmt: skip
    (line,) = ablation.summarize(rows)
    assert line["won_mean"] == pytest.approx(0.5) and line["won_std"] == pytest.approx(0.25)
    assert line["eval_episodes"] == 48 and line["seeds"] == 3
    assert ablation.confidence(line) == "[0.000, 1.000]"  # t(2) = 4.303: three seeds this far apart say little
    close = ablation.summarize([{**r, "won": w} for r, w in zip(rows, [0.5, 0.5625, 0.625])])[0]
    assert ablation.confidence(close) == "[0.407, 0.718]"  # 0.5625 -+ 4.303 x 0.0625 / sqrt(3)
    assert ablation.confidence(ablation.summarize(rows[:1])[0]) == "-"
    with pytest.raises(ValueError, match="appear twice"):  # one seed's row twice is not two seeds
        ablation.summarize([*rows, rows[0]])


def test_a_set_sweep_is_separate_lines_and_seeds_average_within_each(tmp_path, monkeypatch, capsys):
    """Two invocations into one --out that differ by a --set value: the table and the plot keep
    the values apart (each line labelled with its --set) and average the seeds of each."""

    def fake_cell(args, key, out):  # the rows a cell writes, without training: won by learning rate and seed
        won = {"1e-3": 0.0, "1e-2": 0.5}[args.set[0].partition("=")[2]] + 0.25 * key["seed"]
        trained = {"demos": 0, "train_episodes": 4, "train_s": 1.0, "stage": "end", "eval_episodes": 2}
        return [{**key, **trained, "eval": c, "won": won} for c in args.eval]

    monkeypatch.setattr(ablation, "run_cell", fake_cell)
    out = tmp_path / "sweep"
    for lr in ("1e-3", "1e-2"):
        ablation.main(["--splits", "0:1", "--budget", "4", "--seeds", "0", "1", "--out", str(out),
                       "--set", f"model.init_args.learning_rate={lr}"])  # fmt: skip
    capsys.readouterr()
    rows = ablation.load_rows(out / "results.jsonl")
    assert len(rows) == 4 and rows[0]["settings"]["set"] == ["model.init_args.learning_rate=1e-3"]
    lines = ablation.summarize(rows)
    assert [(x["settings"], x["seeds"], x["won_mean"]) for x in lines] == [
        ("--set model.init_args.learning_rate=1e-3", 2, 0.125),
        ("--set model.init_args.learning_rate=1e-2", 2, 0.625),
    ]
    assert all(x["won_std"] == pytest.approx(0.25 / 2**0.5) for x in lines)  # two seeds, 0.25 apart
    table = (out / "results.md").read_text()
    assert "| ppo | dense | 0:1 | 4 | w2-o3-q4 | --set model.init_args.learning_rate=1e-3 | end |" in table
    assert "| --set model.init_args.learning_rate=1e-2 | end | w2-o3-q4 | 0.625 ± 0.177 | 2 |" in table
    plot = ET.fromstring((out / "success.svg").read_text())
    assert len([e for e in plot.iter() if e.tag.endswith("rect")]) == 2
    assert sum("learning_rate=1e-2" in (e.text or "") for e in plot.iter()) == 1


def shared_out_grid(tmp_path) -> tuple:
    """A grid of two seeds (one cell each) writing into a shared --out: its folder, argv, cell names
    and the row a fake cell returns."""
    out = tmp_path / "shared"
    argv = ["--splits", "0:1", "--budget", "4", "--seeds", "0", "1", "--out", str(out)]
    names = [name for name, _ in ablation.grid_cells(ablation.parse_args(argv))]
    row = {"demos": 0, "train_episodes": 4, "train_s": 1.0, "stage": "end", "eval_episodes": 2, "eval": "w2-o3-q4"}
    return out, argv, names, {**row, "won": 0.5}


def test_a_cell_another_grid_finished_meanwhile_is_not_run_again(tmp_path, monkeypatch, capsys):
    """Two grids writing into one --out (one process a core): a cell whose rows the other grid wrote
    while this one ran an earlier cell is kept, not run twice (its seed would be counted twice)."""
    (out, argv, names, fake), ran = shared_out_grid(tmp_path), []

    def cell(args, key, cell_out):
        ran.append(key["seed"])
        row = {**key, **fake}
        if key["seed"] == 0:  # meanwhile the other grid finishes seed 1
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps({"cell": names[1], **row, "seed": 1}) + "\n")
        return [row]

    monkeypatch.setattr(ablation, "run_cell", cell)
    ablation.main(argv)
    assert ran == [0] and "done before, kept" in capsys.readouterr().out
    assert sorted(r["seed"] for r in ablation.load_rows(out / "results.jsonl")) == [0, 1]


def test_a_cell_or_stage_another_grid_is_running_is_not_run_twice(tmp_path, monkeypatch, capsys):
    """Two grids on one --out, each a process: a cell the other grid holds is left to it (this grid goes
    on to the next), and an SFT stage the other is running is waited for, then reused rather than run
    again. (flock: a second open file conflicts with the first within one process too.)"""
    (out, argv, names, fake), ran = shared_out_grid(tmp_path), []
    monkeypatch.setattr(ablation, "run_cell", lambda _, key, __: ran.append(key["seed"]) or [{**key, **fake}])
    with ablation.held(out / "cells" / names[0]):  # the other grid runs seed 0's cell
        ablation.main(argv)
    assert ran == [1] and f"{names[0]}: another grid is running it; left to that grid" in capsys.readouterr().out
    assert [r["seed"] for r in ablation.load_rows(out / "results.jsonl")] == [1]

    args = ablation.parse_args(["--budget", "2", "--splits", "1:1"])
    config, key = ablation.cell_config(args, "ppo", "dense", "1:1", "w2-o3-q4", 0, tmp_path), {"split": "1:1"}
    key.update(train="w2-o3-q4", seed=0)
    _, stage = ablation.sft_stage_of(args, config, key, tmp_path / "sft")
    taken = threading.Event()

    def other_grid():  # holds the stage until it has written the rows and the adapters
        with ablation.held(stage):
            taken.set()
            time.sleep(0.3)
            (stage / "export").mkdir(parents=True)
            (stage / "export" / "team.json").write_text("{}")
            (stage / "after_sft.jsonl").write_text(json.dumps({"won": 0.25, "sft_s": 9.0}) + "\n")

    monkeypatch.setattr(ablation, "build", lambda *_: pytest.fail("the stage ran twice"))
    thread = threading.Thread(target=other_grid)
    thread.start()
    taken.wait()
    found, rows = ablation.sft_stage(args, config, key, tmp_path / "sft")
    thread.join()
    assert found == stage and rows == [{"won": 0.25, "sft_s": 9.0}]
    assert f"{stage.name}: another grid is running it; waiting for it" in capsys.readouterr().out


def test_rows_without_their_settings_are_kept_apart_by_the_cell_hash():
    row = {"algorithm": "ppo", "density": "dense", "split": "0:1", "budget": 4, "train": "w", "stage": "end",
           "eval": "w", "won": 0.5, "eval_episodes": 2, "train_episodes": 4, "demos": 0, "train_s": 1.0}  # fmt: skip
    rows = [{**row, "cell": f"ppo-dense-sft0rl1-b4-w-s{seed}-{key}", "seed": seed} for key in ("aaaaaa", "bbbbbb")
            for seed in (0, 1)]  # fmt: skip
    assert [(x["settings"], x["seeds"]) for x in ablation.summarize(rows)] == [
        ("settings aaaaaa", 2),
        ("settings bbbbbb", 2),
    ]
    defaults = ablation.shared_settings(ablation.parse_args([]))
    assert ablation.settings_label(defaults, "aaaaaa") == "-"
    other = ablation.shared_settings(ablation.parse_args(["--sft-epochs", "4", "--demo-cost", "2", "--set", "a=1"]))
    assert ablation.settings_label(other, "x") == "--demo-cost 2 --sft-epochs 4 --set a=1"


def test_bad_grid_settings_are_named():
    with pytest.raises(SystemExit, match=r"PhaseSwitch.split='60-200'"):
        ablation.main(["--splits", "60-200"])
    with pytest.raises(SystemExit, match=r"--train/--eval='w2-o3': not a complexity"):
        ablation.main(["--eval", "w2-o3"])
    too_many = r"--budget 300 --splits 1:1: 150 demonstrations: count=150: split 'validation' has only 100 seeds"
    with pytest.raises(SystemExit, match=too_many):
        ablation.main(["--budget", "300", "--splits", "1:1"])
    with pytest.raises(SystemExit, match=r"--splits 0:1 has no demonstrations for model.update.sft_coef"):
        ablation.main(["--budget", "100", "--splits", "1:1", "0:1", "--set", "model.init_args.update.sft_coef=0.5"])


LORA_TINY = [*TINY, "model.init_args.lora={r: 2, alpha: 4}", "data.init_args.max_turns=2"]


def test_cells_of_one_seed_start_rl_from_one_sft_run(tmp_path, capsys):
    """--share-sft (default, LoRA models): PPO and GRPO cells of one seed run SFT once and start RL
    from its exported adapters; an SFT-only split ends where SFT left it; a rerun reuses the stage."""
    out = tmp_path / "grid"
    argv = ["--algorithms", "ppo", "grpo", "--splits", "1:1", "--budget", "2", "--train-games", "1",
            "--eval-games", "1", "--out", str(out), "--set", *LORA_TINY]  # fmt: skip
    ablation.main(argv)
    ablation.main(
        ["--algorithms", "ppo", "--splits", "1:0", "--budget", "1", *argv[7:]]
    )  # SFT only, 1 demonstration: same stage
    capsys.readouterr()
    (stage,) = (out / "sft").glob("sft*")  # beside it, the hidden lock its grid held
    assert stage.name.startswith("sft1x1-w2-o3-q4-s0-") and (stage / "export" / "team.json").exists()
    assert len((stage / "after_sft.jsonl").read_text().splitlines()) == 1  # ran once
    rows = ablation.load_rows(out / "results.jsonl")
    assert [(r["algorithm"], r["split"], r["stage"]) for r in rows] == [
        ("ppo", "1:1", "after SFT"), ("ppo", "1:1", "end"), ("grpo", "1:1", "after SFT"), ("grpo", "1:1", "end"),
        ("ppo", "1:0", "after SFT"), ("ppo", "1:0", "end"),
    ]  # fmt: skip
    assert all(r["sft_stage"] == stage.name for r in rows)
    assert len({r["won"] for r in rows if r["stage"] == "after SFT"}) == 1  # one SFT policy, evaluated once
    assert rows[1]["train_episodes"] >= 1 and rows[5]["train_episodes"] == 0 and rows[5]["won"] == rows[4]["won"]
    cell = yaml.safe_load((out / "cells" / rows[1]["cell"] / "config.yaml").read_text())
    assert cell["trainer"]["callbacks"] == [
        {"class_path": "lit_marl.callbacks.InitialWeights", "init_args": {"path": str(stage / "export")}},
        {"class_path": "lit_marl.callbacks.PhaseSwitch", "init_args": {"budget": 1, "split": "0:1"}},
    ]
    assert cell["data"]["init_args"]["demos"]["path"] is None
    shutil.rmtree(stage / "export")  # a fresh clone: git holds the stage's rows, not its adapters
    ablation.main(["--algorithms", "rloo", *argv[3:], "model.init_args.update.sft_coef=0.5"])  # an RL-only setting
    capsys.readouterr()
    assert (stage / "export" / "team.json").exists()  # the stage ran again rather than start RL from nothing
    assert [path.name for path in (out / "sft").glob("sft*")] == [stage.name]
    (learning,) = [r["cell"] for r in ablation.load_rows(out / "results.jsonl") if r["algorithm"] == "rloo"][-1:]
    cell = yaml.safe_load((out / "cells" / learning / "config.yaml").read_text())
    assert cell["data"]["init_args"]["demos"]["path"] == "textworld:w2-o3-q4:validation:1"  # RL learns them too


def test_sft_stages_are_shared_only_where_sft_reads_the_same():
    args = ablation.parse_args(["--budget", "2", "--splits", "1:1"])

    def stage(algorithm="ppo", density="dense", seed=0, lr=None, args=args):
        config = ablation.cell_config(args, algorithm, density, "1:1", "w2-o3-q4", seed, REPO_ROOT)
        if lr is not None:
            config["model"]["init_args"]["learning_rate"] = lr
        switch = {**config["trainer"]["callbacks"][0]["init_args"], "budget": 1, "split": "1:0"}
        return ablation.sft_stage_id(args, config, switch, "w2-o3-q4", seed)

    assert stage() == stage("grpo") == stage("rloo", "sparse")  # RL settings only
    assert len({stage(), stage(seed=1), stage(lr=1e-5), stage(args=ablation.parse_args(["--eval-games", "8"]))}) == 4
    own_rate = ablation.parse_args(["--budget", "2", "--splits", "1:1", "--sft-learning-rate", "1e-3"])
    assert stage(args=own_rate) == stage(lr=1e-5, args=own_rate)  # SFT has its own rate: the RL rate is RL's


def test_alfworld_cells_play_every_task_type():
    """--env alfworld: the game sets name counts per task type (six types), complexities do not apply."""
    args = ablation.parse_args(["--env", "alfworld", "--splits", "48:48", "--budget", "96", "--train-games", "48"])
    config = ablation.cell_config(args, "ppo", "sparse", "48:48", "all", 0, REPO_ROOT)
    data = config["data"]["init_args"]
    paths = (data["env"], data["train_path"], data["demos"]["path"])
    assert paths == ("alfworld", "alfworld:train:8", "alfworld:validation:8")
    assert ablation.shared_settings(args)["env"] == "alfworld"
    assert "env" not in ablation.shared_settings(ablation.parse_args([]))  # TextWorld grids keep their cells' names
    bad = {
        ("--splits", "5:1", "--budget", "6"): "5 demonstrations: give a multiple of 6",
        ("--train", "w2-o3-q4"): "ALFWorld games are not graded by complexity",
        ("--eval-games", "10"): "multiples of 6",
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit, match=message):
            ablation.main(["--env", "alfworld", *argv])
