"""A trained team from its checkpoint (``lit-marl export``, whose command is here, and ``lit-marl chat``).

``load_team``: the algorithm that wrote a checkpoint, built from the settings the checkpoint saved
(what it was trained with: no config needed), every model's weights loaded. ``load_data``: the
run's data module, whose environment renders the agents' prompts from a task row as training did,
built from a config or from the data settings the checkpoint saved. Both build through the
instantiation Lightning's ``load_from_checkpoint`` uses (jsonargparse, nested classes included).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from lightning.pytorch.cli import instantiate_module

from lit_marl import ConfigError, checkpoint_files, config_error_in
from lit_marl.algorithms.base import AgentTeamModule
from lit_marl.data import TaskDataModule
from lit_marl.export import export_team
from lit_marl.fields import regroup_moved
from lit_marl.models import quiet_libraries


def build(base: type, settings: dict, field: str):
    """The subclass of ``base`` that ``settings["_class_path"]`` names, built from the other settings."""
    settings = {k: v for k, v in settings.items() if k != "_instantiator"}
    if "_class_path" not in settings:
        raise ConfigError(f"{field}: no class_path: give the run's config.yaml (saved beside its logs)")
    try:
        return instantiate_module(base, settings)
    except Exception as err:
        cause = config_error_in(err)
        if cause is None:
            why = (str(err).splitlines() or [type(err).__name__])[0]
            raise ConfigError(f"{field}: cannot build {settings['_class_path']}: {why}") from err
        raise cause from None


def load_team(ckpt_path: str) -> tuple[AgentTeamModule, dict]:
    """The algorithm that wrote the checkpoint at ``ckpt_path`` with every model's weights loaded
    (on the CPU, in eval mode), and the checkpoint (tensors memory-mapped)."""
    checkpoint = checkpoint_files.load(ckpt_path)
    if not checkpoint:
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is a folder (a sharded checkpoint, one file of shards per rank): give a "
            "single-file checkpoint (the strategy's save_distributed_checkpoint: false), or export during "
            "training with the HFExport callback, which gathers the shards"
        )
    settings = regroup_moved("model", checkpoint.get("hyper_parameters") or {})
    if "_class_path" not in settings:
        raise ConfigError(
            f"ckpt_path={ckpt_path!r}: the checkpoint does not name its algorithm (written by Trainer.fit outside "
            "lit-marl's command line): load it with <Algorithm>.load_from_checkpoint in Python, or export with "
            "the HFExport callback"
        )
    module = build(AgentTeamModule, settings, "ckpt_path")
    module.build_models()
    module.load_state_dict(checkpoint["state_dict"])
    return module.eval(), checkpoint


def data_settings(config: str | None, checkpoint: dict | None) -> dict:
    """The run's data settings (``_class_path`` and the init arguments): ``config``'s ``data`` section,
    each setting that differs from the checkpoint's said on stderr; or else those the checkpoint
    saved (without an environment given as an object: it is not saved); ``{}`` when neither is given."""
    saved = regroup_moved("data", (checkpoint or {}).get("datamodule_hyper_parameters") or {})
    if config is None:
        return saved
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"--config={config!r}: no such file (the run's config.yaml is saved beside its logs)")
    sections = yaml.safe_load(path.read_text())
    data = sections.get("data") if isinstance(sections, dict) else None
    if not isinstance(data, dict) or "class_path" not in data:
        raise ConfigError(f"--config={config!r}: no data section with a class_path (give the run's config.yaml)")
    if checkpoint is not None:
        checkpoint_files.check_data_settings(saved, data, "chatting")
    return {"_class_path": data["class_path"], **(data.get("init_args") or {})}


def load_data(settings: dict, saved: bool) -> TaskDataModule:
    """The data module of ``settings`` (``data_settings``; ``saved``: the checkpoint's)."""
    if not settings or (saved and "env" not in settings):  # an environment given as an object is not saved
        raise ConfigError(
            "the task's prompts come from the run's data settings, which the checkpoint does not hold (or there is "
            "no checkpoint): give --config with the run's config.yaml (saved beside its logs)"
        )
    return build(TaskDataModule, settings, "--config" if not saved else "the checkpoint's data settings")


def export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-marl export",
        description="Write each agent of a checkpoint's team as a Hugging Face folder (model, tokenizer, chat "
        "template), loadable with from_pretrained: OUT/agent<i> (OUT/shared for a parameter-shared team) and "
        "OUT/team.json. The checkpoint holds the settings it was trained with: no config is needed.",
    )
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by lit-marl fit (e.g. last.ckpt)")
    parser.add_argument("--out", required=True, help="folder that receives the agents' folders")
    parser.add_argument(
        "--lora",
        choices=["merged", "adapter"],
        default="merged",
        help="LoRA agents: merged into their base (default), or the adapter alone",
    )
    return parser


def export_main(argv: list[str] | None = None) -> None:
    """``lit-marl export``: a checkpoint's agents as Hugging Face folders."""
    args = export_parser().parse_args(argv)
    quiet_libraries()
    module, _ = load_team(args.ckpt_path)
    for folder in export_team(module, args.out, args.lora):
        print(f"lit-marl: wrote {folder}")
