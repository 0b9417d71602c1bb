"""What each agent of a text environment reads, and how a reward function of CoMLRL's shape is called.

A formatter (CoMLRL's word; ``data.agent_prompts`` holds one per agent) turns a task row into the
agent's prompt text: a format string filled from the row's fields (``"Write about {topic}"``), a
Python function of the row (``f(item) -> str``, or ``f(item, external_prompts=None)``, as CoMLRL
calls it), or in YAML ``{formatter: package.module:function}``. After the first turn a transition's
returned prompt becomes the row's prompt field and goes through the formatter again, unless
``external_prompt_passthrough`` uses it as it is (CoMLRL's contract).

A reward function with an ``agent_completions`` parameter is lit_marl's
(``f(agent_completions=[agent][joint action], tasks=[joint action])``); any other is called as CoMLRL
calls it: one list of completions per agent as positional arguments, ``batch_items`` (the task rows)
when it takes them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from lit_marl import ConfigError
from lit_marl.tasks import import_object, template_fields


class Formatter:
    """One agent's formatter: a format string or a function of the task row."""

    def __init__(self, spec, where: str):
        if isinstance(spec, dict):
            if set(spec) != {"formatter"}:
                raise ConfigError(
                    f"{where}={spec!r}: give a format string, or {{formatter: package.module:function}} for a function"
                )
            spec = import_object(spec["formatter"], f"{where}.formatter")
        if isinstance(spec, str):
            self.template, self.function, self.name = spec, None, repr(spec)
            self.fields = template_fields(spec)
            self.takes_external = False
        elif callable(spec):
            self.template, self.function = None, spec
            self.name = f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"
            self.fields = set()  # a function reads what it reads; rows are not checked for it
            self.takes_external = accepts(spec, "external_prompts")
        else:
            raise ConfigError(f"{where}={spec!r}: give a format string or a function of the task row")

    def uses(self, field: str) -> bool:
        """Whether the formatter can read ``field`` of the row (a function: assumed so)."""
        return self.template is None or field in self.fields

    def __call__(self, row: dict, external: str | None = None) -> str:
        if self.template is not None:
            return self.template.format(**row)
        if external is not None and self.takes_external:
            text = self.function(row, external_prompts=external)
        else:
            text = self.function(row)
        if not isinstance(text, str):
            raise ValueError(f"formatter {self.name} returned {type(text).__name__}, not the prompt text (a str)")
        return text


def accepts(function: Callable, name: str) -> bool:
    """Whether ``function`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class RewardCall:
    """A reward function called with lit_marl's keywords or CoMLRL's positional lists."""

    def __init__(self, function: Callable, num_agents: int):
        self.function, self.num_agents = function, num_agents
        name = getattr(function, "__qualname__", repr(function))
        try:
            params = list(inspect.signature(function).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = {p.name for p in params}
        keywords_only = params and all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params)
        self.native = "agent_completions" in names or bool(keywords_only)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p for p in params if p.kind in kinds and p.name not in ("batch_items", "prompts")]
        required = [p for p in positional if p.default is inspect.Parameter.empty]
        varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        self.batch_items = accepts(function, "batch_items")
        if "prompts" in names and not self.native:
            raise ConfigError(
                f"data.reward_fn {name}: takes prompts, which lit_marl does not pass to a reward of CoMLRL's shape: "
                "read the prompt from batch_items (the task rows), or take agent_completions= and tasks="
            )
        # CoMLRL's rules (its call_reward_function): one list per agent, or every agent's lists in one argument
        if self.native or varargs or len(positional) == num_agents or (len(required) == num_agents and num_agents > 1):
            self.spread = True
        elif len(positional) == 1:
            self.spread = False
        else:
            raise ConfigError(
                f"data.reward_fn {name}: takes {len(positional)} positional arguments; a reward of CoMLRL's shape "
                f"takes one list of completions per agent ({num_agents}), or all of them as one argument, and "
                "optionally batch_items (the task rows); lit_marl's takes agent_completions= and tasks= (a prompts "
                "argument is not passed: read the prompt from batch_items)"
            )

    def __call__(self, agent_completions: list[list[str]], tasks: list[dict]):
        if self.native:
            return self.function(agent_completions=agent_completions, tasks=tasks)
        args = list(agent_completions) if self.spread else [list(agent_completions)]
        kwargs = {"batch_items": tasks} if self.batch_items else {}
        return self.function(*args, **kwargs)
