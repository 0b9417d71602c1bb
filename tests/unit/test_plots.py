"""``lit-marl plot``: TensorBoard logs (written by hand, and by a real tiny fit) drawn to a PNG."""

from __future__ import annotations

import struct
import sys

import pytest

from lit_marl import ConfigError
from lit_marl.plots import canonical_tag, main, plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(folder, scalars: dict[str, list[tuple[int, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def new_names(offset: float) -> dict[str, list[tuple[int, float]]]:
    steps = range(0, 11)
    return {
        "train/reward": [(s, 0.1 + 0.05 * s + offset) for s in steps],
        "train/reward_std": [(s, 0.1) for s in steps],
        "turn_0/reward": [(s, 0.05 * s + offset) for s in steps],
        "turn_1/reward": [(s, 0.2 + 0.04 * s + offset) for s in steps],
        "eval/success": [(0, 0.1 + offset), (10, 0.5 + offset)],
        "perf/tokens_per_s": [(s, 900.0 + 10 * s) for s in steps],
    }


def old_names(offset: float) -> dict[str, list[tuple[int, float]]]:
    steps = range(0, 11)
    return {
        "train/reward": [(s, 0.1 + 0.05 * s + offset) for s in steps],
        "train/turn0/reward": [(s, 0.05 * s + offset) for s in steps],
        "train/turn1/reward": [(s, 0.2 + 0.04 * s + offset) for s in steps],
        "val/success": [(0, 0.1 + offset), (10, 0.5 + offset)],
        "heldout/reward": [(0, 0.3), (10, 0.6)],
        "train/loss_agent0": [(s, 1.0 / (s + 1)) for s in steps],
        "train/loss_agent1": [(s, 1.2 / (s + 1)) for s in steps],
        "rollout/tokens_per_s": [(s, 800.0) for s in steps],
    }


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """lightning_logs/demo/version_0 and version_1, with the current tag names."""
    root = tmp_path_factory.mktemp("logs") / "demo"
    write_run(root / "version_0", new_names(0.0))
    write_run(root / "version_1", new_names(0.2))
    return root


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_not_blank(path) -> None:
    from matplotlib.image import imread

    pixels = imread(str(path))
    assert pixels.std() > 0.05  # lines, text and axes on the white background


DEFAULT_PANELS = ["train/reward", "turn_*/reward", "eval/success", "perf/tokens_per_s"]


def test_two_runs_are_overlaid(two_runs, tmp_path, capsys):
    out = tmp_path / "fig" / "curves.png"
    result = plot([str(two_runs)], out=out)
    assert result.out == out and out.exists()
    assert result.panels == DEFAULT_PANELS
    assert result.runs == ["version_0", "version_1"]
    # one line per run; the per-turn panel: one per turn per run
    assert result.lines == {"train/reward": 2, "turn_*/reward": 4, "eval/success": 2, "perf/tokens_per_s": 2}
    width, height = png_size(out)
    assert (width, height) == (1560, 810)  # 3 columns x 2 rows at 100 dpi
    assert_not_blank(out)


def test_default_output_and_printout(two_runs, capsys, tmp_path, monkeypatch):
    main([str(two_runs / "version_0")])
    printed = capsys.readouterr().out
    out = two_runs / "version_0" / "curves.png"
    assert f"wrote {out}" in printed
    assert "panels: train/reward (1 lines), turn_*/reward (2 lines), eval/success (1 lines)" in printed
    assert png_size(out)[0] > 0
    out.unlink()
    # several RUN_DIR arguments: curves.png here; --labels name the runs
    monkeypatch.chdir(tmp_path)
    main([str(two_runs / "version_0"), str(two_runs / "version_1"), "--labels", "base", "tuned"])
    printed = capsys.readouterr().out
    assert "runs: base, tuned" in printed and (tmp_path / "curves.png").exists()


def test_seeds_are_averaged_into_one_line_with_their_range(tmp_path):
    """--average REGEX: runs whose labels differ only by REGEX (a grid's seeds) are one line, the
    mean at the steps every one logged, banded from the lowest to the highest; other runs stay."""
    from lit_marl.plots import average_runs, load_runs

    for seed, offset in enumerate([0.0, 0.3, 0.6]):
        write_run(tmp_path / "cells" / f"ppo-s{seed}-ab" / "version_0", new_names(offset))
    write_run(tmp_path / "cells" / "grpo-s0-ab" / "version_0", {"train/reward": [(0, 0.5), (1, 0.7)]})
    short = new_names(0.9)
    short["train/reward"] = short["train/reward"][:4]  # a run that stopped early: the mean only where all logged
    write_run(tmp_path / "cells" / "ppo-s3-ab" / "version_0", short)
    runs = average_runs(load_runs([str(tmp_path / "cells")]), "-s[0-9]+")
    assert [r.label for r in runs] == ["grpo-s0-ab", "ppo-ab (mean of 4)"]  # their common tail left out
    grpo, ppo = runs
    assert grpo.spread == {} and [v for _, v in grpo.scalars["train/reward"]] == pytest.approx([0.5, 0.7])
    assert [s for s, _ in ppo.scalars["train/reward"]] == [0, 1, 2, 3]
    assert ppo.scalars["train/reward"][2][1] == pytest.approx(0.2 + 0.45)  # 0.1 + 0.05 * 2 + mean offset 0.45
    low, high = ppo.spread["train/reward"]
    assert low[2][1] == pytest.approx(0.2) and high[2][1] == pytest.approx(1.1)
    result = plot([str(tmp_path / "cells")], out=tmp_path / "mean.png", tags=["train/reward"], average="-s[0-9]+")
    assert result.lines == {"train/reward": 2} and len(result.runs) == 2
    assert_not_blank(tmp_path / "mean.png")
    with pytest.raises(ConfigError, match="--average 'nothing'.*no two runs"):
        plot([str(tmp_path / "cells")], out=tmp_path / "x.png", average="nothing")
    with pytest.raises(ConfigError, match="--average.*not a regular expression"):
        plot([str(tmp_path / "cells")], out=tmp_path / "x.png", average="(")


def test_tags_globs_replace_the_defaults(two_runs, tmp_path):
    result = plot([str(two_runs)], out=tmp_path / "t.png", tags=["turn_*", "perf/*"])
    assert result.panels == ["turn_0/reward", "turn_1/reward", "perf/tokens_per_s"]
    assert all(n == 2 for n in result.lines.values())
    assert png_size(tmp_path / "t.png") == (1560, 450)  # one row


def test_old_tag_names_feed_the_same_panels(tmp_path):
    assert canonical_tag("train/turn3/reward") == "turn_3/reward"
    assert canonical_tag("val/success") == canonical_tag("heldout/success") == "eval/success"
    assert canonical_tag("train/loss_agent1") == "agent1/loss"
    assert canonical_tag("train/reward") == "train/reward"
    write_run(tmp_path / "old", old_names(0.0))
    write_run(tmp_path / "new", new_names(0.1))
    result = plot([str(tmp_path / "old"), str(tmp_path / "new")], out=tmp_path / "c.png")
    assert result.panels == [
        "train/reward",
        "turn_*/reward",
        "eval/reward",
        "eval/success",
        "agent0/loss",
        "agent1/loss",
        "perf/tokens_per_s",
    ]
    assert result.lines["turn_*/reward"] == 4 and result.lines["eval/success"] == 2
    assert result.lines["eval/reward"] == 1 and result.lines["perf/tokens_per_s"] == 2
    # a glob may name the logged (old) tag too
    assert plot([str(tmp_path / "old")], out=tmp_path / "v.png", tags=["val/*"]).panels == ["eval/success"]


def test_errors_name_the_argument(tmp_path, two_runs):
    with pytest.raises(ConfigError, match=r"RUN_DIR '.*nowhere': no such directory"):
        plot([str(tmp_path / "nowhere")])
    (tmp_path / "empty" / "version_0").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"RUN_DIR '.*empty': no TensorBoard event files"):
        plot([str(tmp_path / "empty")])
    with pytest.raises(ConfigError, match=r"--tags nothing/\*: no tag matches .*train/reward"):
        plot([str(two_runs)], out=tmp_path / "x.png", tags=["nothing/*"])
    with pytest.raises(ConfigError, match=r"--labels: 1 given for 2 run.*version_1\): give one label per run.*RUN_DIR"):
        plot([str(two_runs)], out=tmp_path / "x.png", labels=["one"])
    with pytest.raises(SystemExit, match=r"lit-marl plot: RUN_DIR '.*nowhere'"):
        main([str(tmp_path / "nowhere")])
    assert not (tmp_path / "x.png").exists()


def test_lit_marl_plot_entry(two_runs, tmp_path, monkeypatch, capsys):
    from lit_marl import cli

    def no_cli(*args, **kwargs):
        raise AssertionError("`lit-marl plot` must not build LightningCLI")

    monkeypatch.setattr(cli, "build_cli", no_cli)
    out = tmp_path / "entry.png"
    monkeypatch.setattr(sys, "argv", ["lit-marl", "plot", str(two_runs), "--out", str(out), "--tags", "eval/*"])
    cli.main()
    assert f"wrote {out}" in capsys.readouterr().out
    assert png_size(out) == (520, 450)  # one panel
    monkeypatch.setattr(sys, "argv", ["lit-marl", "plot", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="no such directory"):
        cli.main()


def test_plot_a_real_tiny_fit(tmp_path):
    import lightning as L

    from helpers import make_trainer, slogan_data
    from lit_marl.algorithms import MAGRPO

    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    trainer = make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=1)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 4}, eval_tasks_per_step=2))
    logs = tmp_path / "lightning_logs"
    result = plot([str(logs)])
    assert result.out == logs / "curves.png"
    assert result.panels[0] == "train/reward" and result.lines["train/reward"] == 1
    assert any(p.startswith("eval/") for p in result.panels), result.panels  # the validation pass
    assert png_size(result.out)[0] >= 520
    assert_not_blank(result.out)


def test_csv_logger_runs_are_read_as_event_files(tmp_path):
    """A CSVLogger's metrics.csv (one column per tag, blanks where a row did not log it) gives the
    same points, panels and lines as the same scalars in TensorBoard event files."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_marl.plots import load_scalars

    scalars = new_names(0.0)
    logger = CSVLogger(str(tmp_path / "csv"), name="demo")
    for step in range(11):
        logger.log_metrics({tag: v for tag, points in scalars.items() for s, v in points if s == step}, step=step)
    logger.save()
    write_run(tmp_path / "tb" / "demo" / "version_0", scalars)
    from_csv, _ = load_scalars(tmp_path / "csv" / "demo" / "version_0")
    assert from_csv.keys() == scalars.keys()
    for tag, points in scalars.items():
        assert [s for s, _ in from_csv[tag]] == [s for s, _ in points]
        assert [v for _, v in from_csv[tag]] == pytest.approx([v for _, v in points])
    csv_plot = plot([str(tmp_path / "csv")], out=tmp_path / "csv.png")
    tb_plot = plot([str(tmp_path / "tb")], out=tmp_path / "tb.png")
    assert csv_plot.panels == tb_plot.panels == DEFAULT_PANELS and csv_plot.lines == tb_plot.lines
