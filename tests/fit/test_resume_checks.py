"""Resuming: the config's settings are honoured (or refused by name), and a checkpoint that is missing,
empty, not a checkpoint or damaged is one clear line before any model loads."""

from __future__ import annotations

import pytest
import torch
import yaml

from helpers import REPO_ROOT, checkpointed_config, cli_fit
from lit_marl import ConfigError, checkpoint_files
from lit_marl.cli import build_cli

BASE = REPO_ROOT / "configs/magrpo/slogan_tiny.yaml"


def _config(tmp_path, name: str, data: dict | None = None, **model_args) -> str:
    return checkpointed_config(tmp_path, name, model_args, data)


@pytest.fixture
def checkpoint(magrpo_checkpoint):
    return magrpo_checkpoint


def test_a_changed_learning_rate_is_used_and_said(checkpoint, tmp_path, in_repo_root, capsys):
    """Lightning replaced the whole model section with the checkpoint's and the optimizer state
    carried the old rate: a new learning_rate on resume was ignored twice over. A changed data
    setting was used silently."""
    config = _config(tmp_path, "resume.yaml", data={"sampling": {"max_new_tokens": 8}}, learning_rate=5.0e-4)
    cli = cli_fit(tmp_path, "--ckpt_path", str(checkpoint), "--trainer.max_epochs", "2", config=config)
    said = capsys.readouterr().err
    assert "lit-marl: resuming with model.learning_rate=0.0005 (the checkpoint had 0.001)\n" in said
    assert "lit-marl: resuming with data.sampling.max_new_tokens=8 (the checkpoint had 16)\n" in said
    assert cli.model.hparams.learning_rate == 5.0e-4 and cli.datamodule.sampling.max_new_tokens == 8
    rates = {group["lr"] for optimizer in cli.trainer.optimizers for group in optimizer.param_groups}
    assert rates == {5.0e-4}


def test_validate_with_a_checkpoint_evaluates_it(checkpoint, tmp_path, in_repo_root, capsys):
    """validate and test with --ckpt_path evaluate the checkpoint: they do not resume it. Unchanged
    settings are not mentioned."""
    config = _config(tmp_path, "evaluate.yaml", learning_rate=5.0e-4)
    build_cli(["validate", "--config", config, "--ckpt_path", str(checkpoint), "--trainer.logger", "false"])
    said = capsys.readouterr().err
    assert "lit-marl: evaluating with model.learning_rate=0.0005 (the checkpoint had 0.001)\n" in said
    assert "resuming" not in said and "data." not in said


def test_another_algorithm_is_refused_by_name(checkpoint, tmp_path, in_repo_root, no_model_loads):
    config = yaml.safe_load(BASE.read_text())
    config["model"] = {"class_path": "lit_marl.algorithms.IAC", "init_args": {"model": "tiny-random"}}
    path = tmp_path / "iac.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"written by lit_marl\.algorithms\.MAGRPO, but model\.class_path is .*IAC"):
        cli_fit(tmp_path, "--ckpt_path", str(checkpoint), config=str(path))
    assert no_model_loads == []


def test_a_setting_that_shapes_the_weights_is_refused(checkpoint, tmp_path, in_repo_root, no_model_loads):
    config = _config(tmp_path, "lora.yaml", lora={"r": 4})
    with pytest.raises(ConfigError, match=r"model\.lora: None in the checkpoint, .*'r': 4"):
        cli_fit(tmp_path, "--ckpt_path", str(checkpoint), config=config)
    assert no_model_loads == []


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "no such file"),
        ("empty", "the file is empty"),
        ("text", "not a checkpoint this version can read"),
        ("flipped", "does not match its checksum"),
    ],
)
def test_bad_checkpoints_are_one_line_before_any_model_loads(
    damage, message, checkpoint, tmp_path, in_repo_root, no_model_loads
):
    bad = tmp_path / "bad.ckpt"
    if damage == "empty":
        bad.write_bytes(b"")
    elif damage == "text":
        bad.write_text("this is not a checkpoint\n")
    elif damage == "flipped":  # bytes in the middle, where the tensors are: torch itself loads it
        data = bytearray(checkpoint.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
        bad.write_bytes(bytes(data))
        checkpoint_files.sidecar(bad).write_text(checkpoint_files.sidecar(checkpoint).read_text())
        torch.load(bad, weights_only=True)  # no error of its own: the damage would load silently
    with pytest.raises(ConfigError) as err:
        cli_fit(tmp_path, "--ckpt_path", str(bad), config=_config(tmp_path, "bad.yaml"))
    assert message in str(err.value) and str(err.value).startswith("ckpt_path=")
    assert "\n" not in str(err.value)
    assert no_model_loads == []


def test_a_damaged_checkpoint_is_refused_also_from_python(checkpoint, tmp_path):
    """Trainer.fit(ckpt_path=...) without the CLI: refused in on_load_checkpoint, before any weight
    is applied."""
    from helpers import make_trainer, slogan_data
    from lit_marl.algorithms import MAGRPO

    bad = tmp_path / "last.ckpt"
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    checkpoint_files.sidecar(bad).write_text(checkpoint_files.sidecar(checkpoint).read_text())
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False, max_epochs=2)
    with pytest.raises(ConfigError, match="does not match its checksum"):
        trainer.fit(MAGRPO(model="tiny-random", learning_rate=1e-3), datamodule=slogan_data(), ckpt_path=str(bad))


def test_checksum_record_keeps_the_previous_checkpoint_valid(tmp_path):
    """A kill between recording the new checksum and the rename leaves the old file in place: it
    must still verify."""
    final, new = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    final.write_bytes(b"old")
    checkpoint_files.record(final, final)
    new.write_bytes(b"new")
    checkpoint_files.record(new, final)  # killed here, before os.replace(new, final)
    checkpoint_files.check_recorded(final)
    final.write_bytes(b"new")
    checkpoint_files.check_recorded(final)
    final.write_bytes(b"bad")
    with pytest.raises(ConfigError):
        checkpoint_files.check_recorded(final)


class _Ranks:
    """A strategy as ``check_shared_folder`` uses it, seen from one rank of several (``sees``: what
    the other ranks' filesystem shows of rank 0's file)."""

    def __init__(self, rank: int, others_see: bool):
        self.is_global_zero, self.others_see = rank == 0, others_see

    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision or not self.others_see  # any rank missing the file


def test_checkpoints_need_a_folder_every_rank_sees(tmp_path):
    """With several ranks, StepCheckpoint checks at the start of the fit that every rank sees what
    rank 0 writes in its folder (nodes with their own disks would each keep a part of a sharded
    checkpoint); a rank that does not stops every rank with the fix. The marker is removed."""
    from lit_marl.checkpoint_files import check_shared_folder

    check_shared_folder(tmp_path / "ckpt", _Ranks(0, others_see=True), "StepCheckpoint.dirpath")
    assert list((tmp_path / "ckpt").iterdir()) == []
    with pytest.raises(ConfigError, match="StepCheckpoint.dirpath=.*filesystem every node shares"):
        check_shared_folder(tmp_path / "ckpt", _Ranks(0, others_see=False), "StepCheckpoint.dirpath")
    with pytest.raises(ConfigError, match="does not see the file rank 0 wrote"):  # rank 1, a disk of its own
        check_shared_folder(tmp_path / "elsewhere", _Ranks(1, others_see=True), "StepCheckpoint.dirpath")


def test_a_sharded_checkpoint_swaps_in_after_a_kill_left_the_previous_one_beside_it(tmp_path):
    """A kill after a sharded checkpoint's two renames, before ``last.ckpt.old`` was removed, leaves
    both folders: the next save must still swap its checkpoint in (it used to fail on every later
    save with 'Directory not empty' until someone removed ``.old`` by hand)."""
    from callbacks.checkpoint import StepCheckpoint

    callback = StepCheckpoint(dirpath=str(tmp_path))
    old, partial = tmp_path / "last.ckpt.old", tmp_path / "last.ckpt.partial"
    for folder, name in ((callback.path, "newer"), (old, "older"), (partial, "newest")):
        folder.mkdir()
        (folder / "shard").write_text(name)
    callback.swap_in(partial, old)
    assert (callback.path / "shard").read_text() == "newest" and not old.exists() and not partial.exists()
