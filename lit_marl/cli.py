"""`lit-marl fit|validate|test --config configs/...yaml` through LightningCLI; `lit-marl
plot|export|chat` are commands of their own (``COMMANDS``), run before LightningCLI starts."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import warnings

import torch
import yaml

from lit_marl import ConfigError, checkpoint_files, config_error_in, cpu
from lit_marl.envs.calls import RewardError  # checkpoint_files loads torch already: no start-up to save
from lit_marl.fields import refuse_moved, regroup_moved
from lit_marl.parallel import failure

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the commands that are not a Trainer method: module, its ``f(argv)``, and the line `--help` shows
COMMANDS = {
    "plot": ("lit_marl.plots", "main", "Draw runs' TensorBoard curves to a PNG."),
    "export": ("lit_marl.trained", "export_main", "Write a checkpoint's agents as Hugging Face folders."),
    "chat": ("lit_marl.chat", "main", "Talk to trained agents (a checkpoint or an export), turn by turn."),
}
NOT_PREDICT = (
    "lit-marl: there is no `predict` (agents generate inside rollouts, not in a forward pass): use `lit-marl "
    "chat` to talk to trained agents, `lit-marl validate` or `lit-marl test` for their held-out metrics"
)

# Library lines that say nothing about the run: deprecations inside the libraries (not in our code,
# and nothing a user can act on), a model-summary size note that does not apply to mixed precision,
# and advertisements for hosted services.
LIBRARY_NOISE = (
    r"`is_gradient_checkpointing` is deprecated",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"`LeafSpec` is deprecated",
    r"Precision .* is not supported by the model summary",
)
ADVERTISEMENT = "\N{ELECTRIC LIGHT BULB} Tip:"


def quiet_console() -> None:
    """Keep the library noise above off the terminal, so the run's own lines stand out."""
    from lit_marl.models import quiet_libraries  # deferred: CLI start-up cost (transformers)

    quiet_libraries()
    for message in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(lambda record: not str(record.msg).startswith(ADVERTISEMENT))


# Lightning's default logger without TensorBoard's hp_metric (-1 at every start: no metric of ours).
# A config's own TensorBoardLogger gets default_hp_metric: false too unless it sets it (jsonargparse
# merges a config's init_args into the default's when the class_path is the same).
DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": ".", "default_hp_metric": False},
}


def build_cli(args: list[str] | None = None, run: bool = True):
    from lightning.pytorch.cli import LightningCLI

    from lit_marl.algorithms.base import AgentTeamModule  # deferred: CLI start-up cost
    from lit_marl.callbacks.progress import use_run_progress_bar  # deferred: CLI start-up cost
    from lit_marl.data import TaskDataModule  # deferred: CLI start-up cost

    quiet_console()

    class LitMarlCLI(LightningCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            # no predict: the algorithms have no forward pass to predict with (main() says what to use)
            return {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}

        def _add_subcommands(self, parser, **kwargs) -> None:
            super()._add_subcommands(parser, **kwargs)
            _list_commands(parser._subcommands_action)

        def parse_arguments(self, parser, args) -> None:
            _refuse_moved_settings(args)
            _say_overridden(args)
            super().parse_arguments(parser, args)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except ValueError as err:
                cause = config_error_in(err)  # jsonargparse's long report around an error of ours
                if cause is None:
                    raise
                raise cause from None

        def _parse_ckpt_path(self) -> None:
            # Lightning's replaces the whole model section with the checkpoint's hyperparameters, so a
            # setting changed for the resumed run was silently dropped; here the config is kept, and
            # the checkpoint is checked before any model loads
            subcommand = self.config.get("subcommand")
            if subcommand:
                _check_checkpoint_settings(subcommand, self.config[subcommand])

        def instantiate_trainer(self, **kwargs):
            config = self.config[self.subcommand] if self.subcommand else self.config
            if config.trainer.precision is None:  # unset: what this hardware computes fast (lit_marl/cpu.py);
                # given here, not written into the config: the saved config.yaml keeps it unset for the next CPU
                kwargs.setdefault("precision", _unset_precision(config.trainer.accelerator, config.model))
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
        parser_kwargs={"description": "Multi-agent, multi-turn reinforcement learning of LLM agents."},
        trainer_defaults={"log_every_n_steps": 1, "num_sanity_val_steps": 0, "logger": DEFAULT_LOGGER},
    )


def _unset_precision(accelerator, model) -> str | None:
    """``trainer.precision`` when a config leaves it unset: bf16 weights need bf16 autocast; else a CPU
    run's is the CPU's (``cpu.auto_precision``) and other accelerators keep Lightning's default."""
    init_args = getattr(model, "init_args", None) or {}
    memory = checkpoint_files.plain(init_args.get("memory")) or {}
    if memory.get("weights_dtype", "float32") != "float32":
        return "bf16-mixed"
    name = (accelerator if isinstance(accelerator, str) else getattr(accelerator, "class_path", "")) or "auto"
    if name == "auto":  # Lightning's own order: a GPU, Apple's MPS, else the CPU
        on_cpu = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    else:
        on_cpu = name.lower() == "cpu" or name.lower().endswith(".cpuaccelerator")
    return cpu.auto_precision("cpu" if on_cpu else name)


def _list_commands(subcommands) -> None:
    """``COMMANDS`` in ``lit-marl --help`` beside fit, validate and test (``main`` runs them)."""
    from jsonargparse import ArgumentParser  # deferred: CLI start-up cost

    for name, (_, _, description) in COMMANDS.items():
        subcommands.add_subcommand(name, ArgumentParser(description=description), help=description)


def _check_checkpoint_settings(subcommand: str, config) -> None:
    """The checkpoint of ``--ckpt_path`` (checked first: ``checkpoint_files.load``) against the
    config's model and data sections: resuming (fit) or evaluating (validate, test) with them."""
    path = config.get("ckpt_path")
    if path and path not in ("last", "best", "hpc", "registry"):
        saved, verb = checkpoint_files.load(path), "resuming" if subcommand == "fit" else "evaluating"
        saved_model = regroup_moved("model", saved.get("hyper_parameters") or {})
        checkpoint_files.check_model_settings(saved_model, config["model"], verb)
        saved_data = regroup_moved("data", saved.get("datamodule_hyper_parameters") or {})
        checkpoint_files.check_data_settings(saved_data, config["data"], verb)


def _leaves(tree, prefix: str = "") -> dict:
    """A YAML mapping as ``{dotted.key: value}`` (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _config_leaves(argv: list[str]) -> list[tuple[str, dict]]:
    """Each ``--config`` file of ``argv``, in order, with its settings as ``{dotted.key: value}``."""
    out = []
    for i, token in enumerate(argv[:-1]):
        if token == "--config" and os.path.isfile(argv[i + 1]):
            with open(argv[i + 1]) as f:
                out.append((argv[i + 1], _leaves(yaml.safe_load(f) or {})))
    return out


def _refuse_moved_settings(args: list[str] | None) -> None:
    """A setting given under the key it had before it moved into a group (in a ``--config`` file or
    on the command line) stops the run naming its new key, before jsonargparse's generic report."""
    argv = list(sys.argv[1:] if args is None else args)
    for path, leaves in _config_leaves(argv):
        refuse_moved(leaves, path)
    refuse_moved((t[2:].split("=")[0] for t in argv if t.startswith("--")), "the command line")


def _say_overridden(args: list[str] | None) -> None:
    """A later ``--config`` that replaces a value an earlier one set (a parity preset over a ported
    script's own setting) is said on stderr, naming both files: nothing is replaced silently."""
    seen: dict[str, tuple[object, str]] = {}
    for path, leaves in _config_leaves(list(sys.argv[1:] if args is None else args)):
        for key, value in leaves.items():
            if key in seen and seen[key][0] != value:
                before, where = seen[key]
                sys.stderr.write(f"lit-marl: {key}={value!r} from {path} replaces {before!r} from {where}\n")
            seen[key] = (value, path)


def _where(err: BaseException) -> str:
    """The innermost frame of what caused ``err`` (the user's reward or transition line)."""
    import traceback

    cause = err.__cause__ or err
    frames = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
    if not frames:
        return ""
    frame = frames[-1]
    return f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _short_form(err: BaseException) -> str | None:
    """A configuration error, or a fault of the user's reward or transition, as one line (and the
    line of the user's code it came from); None: the traceback (any other error, LIT_MARL_TRACEBACK=1)."""
    if os.environ.get("LIT_MARL_TRACEBACK"):
        return None
    if isinstance(err, ConfigError):
        return f"configuration error: {err}"
    if isinstance(err, (RewardError, FloatingPointError)):  # the user's reward/transition; a NaN/inf loss
        where = _where(err) if isinstance(err, RewardError) else ""
        return f"{err}{where}\n(LIT_MARL_TRACEBACK=1 shows the whole traceback)"
    return None


def main() -> None:
    """``lit-marl``: a configuration error, or a fault of the user's reward or transition, is one
    line (and the line of the user's code it came from); LIT_MARL_TRACEBACK=1 shows the traceback.
    A rank of several that fails prints it once (``parallel/failure.py``) and the others stop."""
    command = sys.argv[1] if len(sys.argv) > 1 else None
    if command == "predict":
        sys.exit(NOT_PREDICT)
    failure.use_short_form(_short_form)
    try:
        if command in COMMANDS:  # not a Trainer method: no LightningCLI
            module, function, _ = COMMANDS[command]
            return getattr(importlib.import_module(module), function)(sys.argv[2:])
        build_cli()
    except (ConfigError, RewardError, FloatingPointError) as err:
        if failure.reported(err):  # printed by the rank that failed, with its rank
            sys.exit(1)
        short = _short_form(err)
        if short is None:
            raise
        sys.exit(f"lit-marl: {short}")


if __name__ == "__main__":
    main()
