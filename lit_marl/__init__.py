"""lit_marl: multi-agent, multi-turn RL for LLM agents on PyTorch Lightning."""


class ConfigError(ValueError):
    """A bad setting, named by its config field, found before any model is loaded."""
