"""The text samples and histograms of a fit reach every logger that can take them, read back from
what each logger wrote: a W&B offline run (its ``.wandb`` file, read record by record, and its media
files) and an MLflow file store; a logger that cannot take them gets the scalars and one notice.
And TensorBoard's ``hp_metric`` placeholder is off in every logger the CLI builds, unless a config
asks for it."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import make_trainer, slogan_data
from lit_marl.algorithms import MAGRPO
from lit_marl.cli import build_cli
from lit_marl.logger_media import HISTOGRAM_BINS, QUANTILES, StepMedia

NOTICE = "CSVLogger receives the scalars only"


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run (``run-<id>.wandb``: a ``:W&B`` header, then 32 KiB
    blocks of records, each a 7-byte header (checksum, length, type: full/first/middle/last) before
    a piece of a serialized ``Record``), each row as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, part, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_and_mlflow_receive_the_samples_and_histograms_a_csv_logger_a_notice(tmp_path, monkeypatch):
    import wandb
    from mlflow.tracking import MlflowClient

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database unless told
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    settings = wandb.Settings(x_disable_stats=True, x_disable_meta=True)  # no system sampling: a shorter test
    run = WandbLogger(project="lit_marl", save_dir=str(tmp_path / "wandb"), offline=True, settings=settings)
    mlflow = MLFlowLogger(experiment_name="lit_marl", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    csv = CSVLogger(str(tmp_path / "csv"))

    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, log_samples_every_n_steps=1)
    data = slogan_data(sampling={"max_new_tokens": 4}, tasks_per_step=1, num_generations=2)
    trainer = make_trainer(tmp_path, limit_train_batches=2, limit_val_batches=0, logger=[run, mlflow, csv])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=data)
        files = Path(run.experiment.dir)  # the run's files/ folder, beside its .wandb file
        wandb.finish()
    finally:
        wandb.teardown()

    # W&B: one row per step, the scalars with the histograms and the rendered tree
    rows = sorted(wandb_history(files.parent), key=lambda r: r["trainer/global_step"])
    assert [r["trainer/global_step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/reward_hist/_type"] == "histogram" and row["turn_0/reward_hist/_type"] == "histogram"
        assert len(row["train/reward_hist/bins"]) == HISTOGRAM_BINS + 1  # the slogan reward's range [0, 1]
        assert sum(row["train/reward_hist/values"]) == 2  # both joint actions of the step's one node
        assert row["agent0/advantage_hist/_type"] == "histogram"  # no known range: W&B's own bins
        assert 0.0 <= row["train/reward"] <= 1.0
        assert row["train/sample/_type"] == "html-file"
        html = (files / row["train/sample/path"]).read_text()
        assert "<li>prompt of agent 1:" in html and "joint action" in html

    # MLflow: the sample as a Markdown artifact per step, the distributions' quantiles as metrics
    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    artifacts = [a.path for a in client.list_artifacts(mlflow.run_id, "train/sample")]
    assert artifacts == ["train/sample/step_000001.md", "train/sample/step_000002.md"]
    text = Path(client.download_artifacts(mlflow.run_id, artifacts[0], str(tmp_path / "down"))).read_text()
    assert "- prompt of agent 1:" in text and "- joint action" in text
    for step in (1, 2):
        values = {
            key: [m.value for m in client.get_metric_history(mlflow.run_id, key) if m.step == step]
            for key in ("train/reward_min", "train/reward_max", *(f"train/reward_p{q}" for q in QUANTILES))
        }
        points = [values["train/reward_min"], *(values[f"train/reward_p{q}"] for q in QUANTILES)]
        points.append(values["train/reward_max"])
        assert all(len(v) == 1 for v in points) and [v[0] for v in points] == sorted(v[0] for v in points)

    # CSV: the scalars, and one notice for the run (two steps had samples)
    notices = [str(w.message) for w in caught if NOTICE in str(w.message)]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert "TensorBoardLogger, WandbLogger, MLFlowLogger" in notices[0]
    (metrics,) = (tmp_path / "csv").rglob("metrics.csv")
    assert "train/reward" in metrics.read_text().splitlines()[0]


def test_media_skip_empty_distributions_and_a_step_with_nothing_says_nothing():
    media = StepMedia()
    csv = CSVLogger("unused")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert media.write(csv, 1, {"r": torch.zeros(0)}, {}, {}) == {}  # nothing to write: no notice
        assert not caught
        media.write(csv, 1, {"r": torch.ones(2)}, {}, {})
        media.write(csv, 2, {}, {}, {"t": "text"})
    assert [NOTICE in str(w.message) for w in caught] == [True]


def _tensorboard_scalars(root: Path) -> set[str]:
    (events,) = root.rglob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


def test_cli_loggers_write_no_hp_metric_unless_a_config_asks(in_repo_root, tmp_path):
    """A config's TensorBoardLogger (alone or in a list) and the default logger (a config without
    one; it writes under trainer.default_root_dir, as Lightning's own) log hyperparameters without
    TensorBoard's ``hp_metric = -1``; a config that sets ``default_hp_metric: true`` gets it."""
    config = "configs/magrpo/slogan_tiny.yaml"
    source = yaml.safe_load(Path(config).read_text())
    logger = source["trainer"].pop("logger")
    (tmp_path / "no_logger.yaml").write_text(yaml.safe_dump(source))
    logger["init_args"]["save_dir"] = str(tmp_path / "listed")
    csv = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path / "csv")}}
    (tmp_path / "listed.yaml").write_text(yaml.safe_dump({"trainer": {"logger": [csv, logger]}}))
    runs = {
        "config": ["--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path / "config")],
        "asked": [
            *("--config", config, "--trainer.logger.init_args.save_dir", str(tmp_path / "asked")),
            *("--trainer.logger.init_args.default_hp_metric", "true"),
        ],
        "default": ["--config", str(tmp_path / "no_logger.yaml"), "--trainer.default_root_dir", str(tmp_path / "root")],
        "listed": ["--config", config, "--config", str(tmp_path / "listed.yaml")],  # second in a list
    }
    scalars = {}
    for name, args in runs.items():
        logger = build_cli(args=args, run=False).trainer.loggers[-1]
        assert Path(logger.log_dir).is_relative_to(tmp_path / ("root" if name == "default" else name))
        logger.log_hyperparams({"learning_rate": 1e-3})
        logger.finalize("success")
        scalars[name] = _tensorboard_scalars(Path(logger.log_dir))
    assert {name for name, tags in scalars.items() if "hp_metric" in tags} == {"asked"}
