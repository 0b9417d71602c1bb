"""`lit-marl fit|validate|test --config configs/...yaml` through LightningCLI."""

from __future__ import annotations

import os

from lit_marl import ConfigError, checkpoint_files
from lit_marl.envs.calls import RewardError  # checkpoint_files loads torch already: no start-up to save

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Lightning's default logger without TensorBoard's hp_metric (-1 at every start: no metric of ours).
# A config's own TensorBoardLogger gets default_hp_metric: false too unless it sets it (jsonargparse
# merges a config's init_args into the default's when the class_path is the same).
DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": ".", "default_hp_metric": False},
}


def build_cli(args: list[str] | None = None, run: bool = True):
    import warnings

    import transformers
    from lightning.pytorch.cli import LightningCLI

    from lit_marl.algorithms.base import AgentTeamModule  # deferred: CLI start-up cost
    from lit_marl.callbacks.progress import use_run_progress_bar  # deferred: CLI start-up cost
    from lit_marl.data import TaskDataModule  # deferred: CLI start-up cost

    # HF models load in eval mode and we keep it: no dropout, so training scores the very policy
    # that sampled (the warning assumes supervised training)
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    class LitMarlCLI(LightningCLI):
        def instantiate_classes(self) -> None:
            # jsonargparse wraps errors raised in __init__ in a long union report; surface ours
            try:
                super().instantiate_classes()
            except ValueError as err:
                cause = err
                while cause is not None and not isinstance(cause, ConfigError):
                    cause = cause.__cause__
                if cause is None:
                    raise
                raise cause from None

        def _parse_ckpt_path(self) -> None:
            # Lightning's replaces the whole model section with the checkpoint's hyperparameters, so a
            # setting changed for the resumed run was silently dropped; here the config is kept, and
            # the checkpoint is checked before any model loads
            subcommand = self.config.get("subcommand")
            path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if path and path not in ("last", "best", "hpc", "registry"):
                saved = checkpoint_files.verify(path)
                _check_resumed_settings(saved, self.config[subcommand]["model"])

        def instantiate_trainer(self, **kwargs):
            return use_run_progress_bar(super().instantiate_trainer(**kwargs))

        def before_instantiate_classes(self) -> None:
            # the default logger writes under trainer.default_root_dir, as Lightning's own does
            trainer = (self.config[self.subcommand] if self.subcommand else self.config).trainer
            logger = trainer.logger
            if trainer.default_root_dir and getattr(logger, "class_path", None) == DEFAULT_LOGGER["class_path"]:
                if logger.init_args.get("save_dir") == ".":  # no save_dir named: the default's
                    logger.init_args.save_dir = trainer.default_root_dir

        def add_arguments_to_parser(self, parser) -> None:
            # the number of agents is the number of prompt templates: said once, in the data
            parser.link_arguments("data.num_agents", "model.init_args.num_agents", apply_on="instantiate")

    return LitMarlCLI(
        AgentTeamModule,
        TaskDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # each learner has its own AdamW (configure_optimizers): a CLI-wide --optimizer could not apply
        auto_configure_optimizers=False,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"log_every_n_steps": 1, "num_sanity_val_steps": 0, "logger": DEFAULT_LOGGER},
    )


# settings that shape the weights or the optimizers' parameters: a checkpoint cannot resume without them
STRUCTURAL = ("model", "num_agents", "lora", "share_parameters", "lora_shared_base", "critic", "critic_model")


def _plain(value):
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if hasattr(value, "__dataclass_fields__"):
        value = {k: getattr(value, k) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_resumed_settings(saved: dict, model) -> None:
    """Compare a checkpoint's hyperparameters with the config's ``model`` section: another algorithm
    or a setting that shapes the weights is refused (naming the keys); other changes are kept and
    listed on stderr."""
    import sys

    saved = {k: v for k, v in saved.items() if k != "_instantiator"}
    saved_class = saved.pop("_class_path", None)
    config = _plain(model)
    class_path, now = config.get("class_path"), config.get("init_args") or {}
    if saved_class and class_path and saved_class != class_path:
        raise ConfigError(
            f"ckpt_path: the checkpoint was written by {saved_class}, but model.class_path is {class_path}. Resume "
            f"with the checkpoint's algorithm (the run's config.yaml beside its logs has it), or start a new run"
        )
    changed = {k: (_plain(saved[k]), now[k]) for k in sorted(saved.keys() & now.keys()) if _plain(saved[k]) != now[k]}
    shaped = [k for k in changed if k in STRUCTURAL]
    if shaped:
        detail = "; ".join(f"model.{k}: {changed[k][0]!r} in the checkpoint, {changed[k][1]!r} now" for k in shaped)
        raise ConfigError(
            f"ckpt_path: {detail}. These shape the weights the checkpoint holds: resume with the checkpoint's "
            "values, or start a new run without --ckpt_path"
        )
    for key, (before, after) in changed.items():
        sys.stderr.write(f"lit-marl: resuming with model.{key}={after!r} (the checkpoint had {before!r})\n")


def _where(err: BaseException) -> str:
    """The innermost frame of what caused ``err`` (the user's reward or transition line)."""
    import traceback

    cause = err.__cause__ or err
    frames = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
    if not frames:
        return ""
    frame = frames[-1]
    return f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def main() -> None:
    """``lit-marl``: a configuration error, or a fault of the user's reward or transition, is one
    line (and the line of the user's code it came from); LIT_MARL_TRACEBACK=1 shows the traceback."""
    import sys

    if sys.argv[1:2] == ["plot"]:  # `lit-marl plot RUN_DIR ...`: TensorBoard curves to a PNG, no LightningCLI
        from lit_marl.plots import main as plot_main  # deferred: matplotlib start-up cost

        return plot_main(sys.argv[2:])
    try:
        build_cli()
    except ConfigError as err:
        if os.environ.get("LIT_MARL_TRACEBACK"):
            raise
        sys.exit(f"lit-marl: configuration error: {err}")
    except (RewardError, FloatingPointError) as err:  # the user's reward/transition; a NaN/inf loss
        if os.environ.get("LIT_MARL_TRACEBACK"):
            raise
        where = _where(err) if isinstance(err, RewardError) else ""
        sys.exit(f"lit-marl: {err}{where}\n(LIT_MARL_TRACEBACK=1 shows the whole traceback)")


if __name__ == "__main__":
    main()
