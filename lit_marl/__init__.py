"""lit_marl: multi-agent, multi-turn RL for LLM agents on PyTorch Lightning."""

from lit_marl.cpu import thread_env

# before anything loads torch and its OpenMP, which reads its wait policy once (lit_marl/cpu.py)
thread_env()


class ConfigError(ValueError):
    """A bad setting, named by its config field, found before any model is loaded."""


def config_error_in(err: BaseException | None) -> ConfigError | None:
    """The ``ConfigError`` behind ``err``: jsonargparse wraps an error raised in an ``__init__`` in
    its own long report, and the user's fix is in ours."""
    while err is not None and not isinstance(err, ConfigError):
        err = err.__cause__
    return err
