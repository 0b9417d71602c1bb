"""`lit-marl fit|validate|test --config configs/...yaml` through LightningCLI."""

from __future__ import annotations

import os

from lit_marl import ConfigError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_cli(args: list[str] | None = None, run: bool = True):
    import warnings

    import transformers
    from lightning.pytorch.cli import LightningCLI

    from lit_marl.algorithms.base import AgentTeamModule  # deferred: CLI start-up cost
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

        def add_arguments_to_parser(self, parser) -> None:
            # the number of agents is the number of prompt templates: said once, in the data
            parser.link_arguments("data.num_agents", "model.init_args.num_agents", apply_on="instantiate")

    return LitMarlCLI(
        AgentTeamModule,
        TaskDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"log_every_n_steps": 1, "num_sanity_val_steps": 0},
    )


def main() -> None:
    import sys

    try:
        build_cli()
    except ConfigError as err:
        sys.exit(f"lit-marl: configuration error: {err}")


if __name__ == "__main__":
    main()
