"""Checkpoint files that cannot be half-written or silently damaged (bottom layer: stdlib + torch).

``StepCheckpoint`` writes ``last.ckpt`` beside a temporary file, flushes it to disk (``fsync``) and
renames it over the old one; before the rename it records the new file's SHA-256 in
``last.ckpt.sha256`` next to the previous checkpoint's (so a kill between the two renames leaves
a pair that still matches). ``verify`` checks a checkpoint before anything loads it: it exists, is
not empty, matches its recorded checksum when it has one, and is a checkpoint torch can read
without running code. Every failure is one ``ConfigError`` line naming ``ckpt_path``.

``check_model_settings`` and ``check_data_settings`` compare the settings a checkpoint saved with
a run's config (fit, validate or test with ``--ckpt_path``): another algorithm or a setting that
shapes the weights is refused, every other change is used and said on stderr.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from pathlib import Path

import torch

from lit_marl import ConfigError
from lit_marl.fields import regroup_moved

SUFFIX = ".sha256"


def checksum(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sidecar(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in ``path`` durable (power loss after the rename keeps the new name)."""
    try:
        fsync_file(path)
    except OSError:  # file systems that cannot sync a folder
        pass


def record(written: str | os.PathLike, final: str | os.PathLike) -> None:
    """Before ``written`` is renamed to ``final``: add its checksum to ``final``'s record, keeping
    the previous one (the checkpoint still in place until the rename)."""
    previous = []
    card = sidecar(final)
    if card.is_file():
        previous = card.read_text().split()[-1:]
    partial = card.with_name(card.name + ".partial")
    partial.write_text("\n".join([*previous, checksum(written)]) + "\n")
    fsync_file(partial)
    os.replace(partial, card)


_verified: dict[tuple, str] = {}


def check_recorded(path: str | os.PathLike, field: str = "ckpt_path") -> None:
    """Raise ``ConfigError`` when ``path`` has a checksum record that its bytes do not match (a
    checkpoint without a record, written elsewhere, passes). Each file version is hashed once."""
    path, card = Path(path), sidecar(path)
    if not (path.is_file() and card.is_file()):
        return
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _verified:
        _verified[key] = checksum(path)
    if _verified[key] not in card.read_text().split():
        raise ConfigError(
            f"{field}={str(path)!r}: the file does not match its checksum in {card.name} (damaged after it "
            "was written: disk, copy or a partial transfer). Do not resume from it: copy it again or use "
            "another checkpoint"
        )


def verify(path: str | os.PathLike, field: str = "ckpt_path") -> dict:
    """Check the checkpoint at ``path`` and return its ``hyper_parameters`` (empty when it has none);
    raise ``ConfigError`` with the reason and the fix. A folder (a sharded FSDP checkpoint) is only
    checked to exist."""
    return dict(load(path, field).get("hyper_parameters") or {})


def load(path: str | os.PathLike, field: str = "ckpt_path") -> dict:
    """The checkpoint at ``path``, checked as ``verify`` says (tensors memory-mapped, nothing run);
    a folder (a sharded FSDP checkpoint) gives ``{}``."""
    path = Path(path)
    if path.is_dir():
        return {}
    if not path.is_file():
        raise ConfigError(
            f"{field}={str(path)!r}: no such file. Give the path of a checkpoint (StepCheckpoint writes "
            "<dirpath>/last.ckpt), or leave ckpt_path out to start a new run"
        )
    if path.stat().st_size == 0:
        raise ConfigError(
            f"{field}={str(path)!r}: the file is empty (0 bytes; a write that never finished?). "
            f"Resume from an earlier checkpoint (e.g. {path.name}.old) or start a new run"
        )
    check_recorded(path, field)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        raise ConfigError(
            f"{field}={str(path)!r}: not a checkpoint this version can read ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160] if str(err) else 'no detail'}). Give a .ckpt written by lit-marl fit"
        ) from None
    if not isinstance(saved, dict) or "state_dict" not in saved:
        raise ConfigError(f"{field}={str(path)!r}: a torch file but not a Lightning checkpoint (no state_dict)")
    return saved


def configured_settings_win(
    checkpoint: dict, learning_rate: float, critic_learning_rate: float | None, weight_decay: float
) -> None:
    """The configured learning rates and weight decay win over the checkpoint's: torch restores
    each parameter group's ``lr`` and ``weight_decay`` with the optimizer state, so a group still
    at the checkpoint's setting gets the configured one (a group another schedule set, e.g.
    PhaseSwitch's SFT rate, keeps its value)."""
    saved = regroup_moved("model", checkpoint.get("hyper_parameters") or {})
    if "learning_rate" not in saved:
        return
    old_lr = saved["learning_rate"]
    old = {"policy": old_lr, "critic": (saved.get("critic") or {}).get("learning_rate") or old_lr}
    new = {"policy": learning_rate, "critic": critic_learning_rate}
    old_decay = saved.get("weight_decay", 0.0)
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            role = group.get("role")
            if role in new and new[role] is not None and group.get("lr") == old[role]:
                group["lr"] = new[role]
            if group.get("weight_decay") == old_decay:
                group["weight_decay"] = weight_decay


def rank_state(shuffle_generator: torch.Generator, rollout_buffers: list) -> dict:
    """What Lightning does not save, for this rank: the sampling RNG (rollouts continue with the
    same random numbers), the mini-batch order generator, the samples waiting in the rollout buffers."""
    return {
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "shuffle_rng": shuffle_generator.get_state(),
        "buffers": [buffer.state_dict() for buffer in rollout_buffers],
    }


def restore_rank_state(
    saved: dict, world_size: int, rank: int, shuffle_generator: torch.Generator, rollout_buffers: list, name: str
) -> dict:
    """``rank_state`` of this rank applied back (RNGs, buffers); returns it (an algorithm's own keys too)."""
    if len(saved["ranks"]) != world_size:
        raise ConfigError(
            f"the checkpoint was written by {len(saved['ranks'])} ranks, this run has {world_size}: resume "
            "with the same number of devices and nodes (the rollout buffers and RNG states are per rank)"
        )
    state = saved["ranks"][rank]
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    shuffle_generator.set_state(state["shuffle_rng"])
    if len(state["buffers"]) != len(rollout_buffers):
        raise ConfigError(
            f"the checkpoint holds {len(state['buffers'])} rollout buffers, this {name} has "
            f"{len(rollout_buffers)}: resume with the same algorithm and number of agents"
        )
    for buffer, buffered in zip(rollout_buffers, state["buffers"]):
        buffer.load_state_dict(buffered)
    return state


def check_shared_folder(folder: Path, strategy, field: str) -> None:
    """Every rank sees the file rank 0 writes in ``folder`` (a filesystem all nodes share), or every
    rank stops with the fix: a sharded checkpoint has each rank write its shards there."""
    token = strategy.broadcast(secrets.token_hex(8))
    marker = Path(folder) / f".lit_marl_shared_{token}"
    if strategy.is_global_zero:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    strategy.barrier("check_shared_folder")
    missing = strategy.reduce_boolean_decision(not marker.is_file(), all=False)
    strategy.barrier("check_shared_folder")
    if strategy.is_global_zero:
        marker.unlink(missing_ok=True)
    if missing:
        raise ConfigError(
            f"{field}={str(folder)!r}: a rank does not see the file rank 0 wrote there; checkpoints need a folder "
            "on a filesystem every node shares (NFS, Lustre, a cloud mount): give such a path"
        )


# ---------------------------------------------------------------------- saved settings against a config
# settings that shape the weights or the optimizers' parameters: a checkpoint cannot resume without them
STRUCTURAL = ("model", "num_agents", "lora", "share_parameters", "lora_shared_base", "critic", "critic_model")


def plain(value):
    """A config value as plain data (jsonargparse namespaces, dataclasses and tuples undone)."""
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _changes(saved: dict, section) -> tuple[str | None, str | None, dict]:
    """(the checkpoint's class path, the config's, {key: (checkpoint's value, config's)} of the
    settings both give and that differ)."""
    saved = {k: v for k, v in saved.items() if k != "_instantiator"}
    saved_class = saved.pop("_class_path", None)
    config = plain(section) or {}
    now = config.get("init_args") or {}
    given = {k for k in now if not (k == "num_agents" and now[k] is None)}  # None: the data's, linked at instantiation
    changed = {}
    for k in sorted(saved.keys() & given):
        before, after = plain(saved[k]), now[k]
        if isinstance(before, dict) and isinstance(after, dict):  # a settings group: its changed fields
            changed.update(
                {
                    f"{k}.{f}": (before.get(f), after.get(f))
                    for f in sorted(before.keys() | after.keys())
                    if before.get(f) != after.get(f)
                }  # fmt: skip
            )
        elif before != after:
            changed[k] = (before, after)
    return saved_class, config.get("class_path"), changed


def _say(verb: str, key: str, before, after) -> None:
    sys.stderr.write(f"lit-marl: {verb} with {key}={after!r} (the checkpoint had {before!r})\n")


def check_model_settings(saved: dict, model, verb: str = "resuming") -> None:
    """Compare a checkpoint's hyperparameters with the config's ``model`` section: another algorithm
    or a setting that shapes the weights is refused (naming the keys); other changes are kept and
    said on stderr (``verb``: ``resuming`` for fit, ``evaluating`` for validate and test)."""
    saved_class, class_path, changed = _changes(saved, model)
    if saved_class and class_path and saved_class != class_path:
        raise ConfigError(
            f"ckpt_path: the checkpoint was written by {saved_class}, but model.class_path is {class_path}. Resume "
            f"with the checkpoint's algorithm (the run's config.yaml beside its logs has it), or start a new run"
        )
    shaped = [k for k in changed if k.split(".")[0] in STRUCTURAL]
    if shaped:
        detail = "; ".join(f"model.{k}: {changed[k][0]!r} in the checkpoint, {changed[k][1]!r} now" for k in shaped)
        raise ConfigError(
            f"ckpt_path: {detail}. These shape the weights the checkpoint holds: resume with the checkpoint's "
            "values, or start a new run without --ckpt_path"
        )
    for key, (before, after) in changed.items():
        _say(verb, f"model.{key}", before, after)


def check_data_settings(saved: dict, data, verb: str = "resuming") -> None:
    """Compare the data module settings a checkpoint saved with the config's ``data`` section: the
    data shapes no weights, so every change is kept, and each one is said on stderr."""
    saved_class, class_path, changed = _changes(saved, data)
    if saved_class and class_path and saved_class != class_path:
        _say(verb, "data.class_path", saved_class, class_path)
    for key, (before, after) in changed.items():
        _say(verb, f"data.{key}", before, after)
