"""Single-field rules carried by the types of the settings, and the one check that enforces them.

Settings are typed ``__init__`` arguments: a ``Literal`` names the choices (LightningCLI validates
it), and the number types below carry their bounds as ``Annotated`` metadata (shown in ``--help``).
``check_fields`` applies the rules when a class is built, from a config or in Python, so a bad value
fails at construction, before any model loads, with the field, the value and the rule::

    lit-marl: configuration error: model.clip_range=1.5: must be > 0 and < 1

``__init__`` itself raises only for combinations of fields.
"""

from __future__ import annotations

import operator
import types
import typing
from dataclasses import asdict, dataclass
from typing import Annotated, Literal, Union

from lit_marl import ConfigError

_OPERATORS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


@dataclass(frozen=True)
class Bound:
    """A bound a number must satisfy, e.g. ``Bound(">", 0)``; the bounds of one type all hold."""

    op: Literal[">", ">=", "<", "<="]
    ref: float

    def __repr__(self) -> str:
        return f"{self.op} {self.ref:g}"


PositiveInt = Annotated[int, Bound(">", 0)]
NonNegativeInt = Annotated[int, Bound(">=", 0)]
PositiveFloat = Annotated[float, Bound(">", 0)]
NonNegativeFloat = Annotated[float, Bound(">=", 0)]
ClosedUnitInterval = Annotated[float, Bound(">=", 0), Bound("<=", 1)]
"""A float in [0, 1], e.g. a discount."""
OpenUnitInterval = Annotated[float, Bound(">", 0), Bound("<", 1)]
"""A float in (0, 1), e.g. PPO's clip range."""
UnitIntervalLeftOpen = Annotated[float, Bound(">", 0), Bound("<=", 1)]
"""A float in (0, 1], e.g. nucleus sampling's top_p."""
UnitIntervalRightOpen = Annotated[float, Bound(">=", 0), Bound("<", 1)]
"""A float in [0, 1), e.g. a weight that must stay below a unit reward."""
AboveOne = Annotated[float, Bound(">", 1)]
"""A float > 1, e.g. dual-clip PPO's bound on the ratio of a negative-advantage token."""


def check_fields(prefix: str, function, arguments: dict) -> None:
    """Raise ``ConfigError`` for the first argument of ``function`` (by its annotations) whose value
    breaks its type's rule; ``prefix`` is the config section (``model``, ``data``)."""
    hints = typing.get_type_hints(function, include_extras=True)
    for name, value in arguments.items():
        if name in hints:
            problem = _violation(hints[name], value)
            if problem is not None:
                raise ConfigError(f"{prefix}.{name}={value!r}: {problem}")


def as_group(cls, value):
    """A settings group from YAML (a dict) or Python (the dataclass itself, or None: the defaults)."""
    if value is None:
        return cls()
    return cls(**value) if isinstance(value, dict) else value


def saved_groups(module, **groups) -> None:
    """Each settings group's plain values into ``module``'s saved hyperparameters under its config key
    (checkpoints load ``weights_only``: no dataclass in them)."""
    for name, group in groups.items():
        module.hparams[name] = asdict(group)


def check_dataclass(prefix: str, instance) -> None:
    """``check_fields`` on every field of a settings dataclass (call it in ``__post_init__``)."""
    check_fields(prefix, type(instance), {name: getattr(instance, name) for name in instance.__dataclass_fields__})


def _violation(hint, value) -> str | None:
    """What is wrong with ``value`` for ``hint``, or None (also for types it does not judge)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return None if value in choices else f"choose {', '.join(map(str, choices))}"
    if origin in (Union, types.UnionType):
        return _union_violation(typing.get_args(hint), value)
    if origin is not Annotated or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    bounds = [b for b in hint.__metadata__ if isinstance(b, Bound)]
    if all(_OPERATORS[b.op](value, b.ref) for b in bounds):
        return None
    return "must be " + " and ".join(map(repr, bounds))


def _union_violation(members: tuple, value) -> str | None:
    optional = type(None) in members
    if value is None and optional:
        return None
    members = tuple(m for m in members if m is not type(None))
    problems = [_violation(m, value) for m in members]
    if any(p is None and _accepts(m, value) for m, p in zip(members, problems)):
        return None
    literals = [c for m in members if typing.get_origin(m) is Literal for c in typing.get_args(m)]
    others = [m for m in members if typing.get_origin(m) is not Literal]
    if not literals:
        problem = next((p for p in problems if p is not None), None)
        return None if problem is None else problem + (" (or null)" if optional else "")
    alternatives = [_a(_name(m)) for m in others] + (["null"] if optional else [])
    return f"choose {', '.join(map(str, literals))}" + (
        f" (or give {' or '.join(alternatives)})" if alternatives else ""
    )


def _accepts(member, value) -> bool:
    """Whether ``value`` can be of ``member`` (a class, a generic such as ``list[Role]``); types not
    judged here accept."""
    if typing.get_origin(member) is Annotated:
        member = typing.get_args(member)[0]
    kind = typing.get_origin(member) or member
    if typing.get_origin(member) is Literal:
        return value in typing.get_args(member)
    if isinstance(kind, type) and kind.__module__ == "builtins":
        return isinstance(value, kind)
    return True


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _name(member) -> str:
    if typing.get_origin(member) is Annotated:
        member = typing.get_args(member)[0]
    kind = typing.get_origin(member) or member
    return getattr(kind, "__name__", str(kind))


# ---------------------------------------------------------------------------- settings that moved
# A setting moved into its group keeps its name there unless the group's name says it (``demo_path`` is
# ``demos.path``); its old key is refused with the new one named (``docs/config.md``, "Moved settings",
# is generated from this table). Per group: its fields, each with its name before the move.
_GROUPS = {
    "data.reward_calls": {
        "on_reward_error": "on_reward_error",
        "reward_timeout_s": "reward_timeout_s",
        "transition_timeout_s": "transition_timeout_s",
        "transition_prompt_field": "transition_prompt_field",
        "max_skipped_steps": "max_skipped_steps",
    },
    "data.sampling": {name: name for name in ("max_new_tokens", "temperature", "top_p", "top_k")},
    "data.demos": {"path": "demo_path", "batch_size": "demo_batch_size", "loss_on": "demo_loss_on"},
    "model.update": {
        name: name
        for name in (
            "ppo_epochs",
            "train_batch_size",
            "clip_range",
            "dual_clip",
            "target_kl",
            "entropy_coef",
            "logprob_reduction",
            "rollout_is_cap",
            "skip_signalless_steps",
        )
    },
    "model.advantage": {
        "normalization": "advantage_normalization",
        "mode": "advantage_mode",
        "normalization_form": "advantage_normalization_form",
        "std_floor": "advantage_std_floor",
        "turn_level": "turn_level_advantages",
        "step_weight": "step_advantage_weight",
        "gae": "gae",
        "gae_lambda": "gae_lambda",
    },
    "model.kl": {"coef": "kl_coef", "mode": "kl_mode", "clamp": "kl_clamp"},
    "model.buffer": {"size": "rollout_buffer_size", "schedule": "update_schedule"},
    "model.memory": {
        name: "memory_check" if name == "check" else name
        for name in ("forward_token_budget", "forward_batch_size", "activation_checkpointing", "weights_dtype", "check")
    },
    "model.pairs": {"selection": "pair_selection", "per_task": "preference_pairs_per_sample"},
    "model.critic": {
        "kind": "critic",
        "model": "critic_model",
        "type": "critic_type",
        "learning_rate": "critic_learning_rate",
        "value_loss_coef": "value_loss_coef",
        "value_clip_range": "value_clip_range",
        "warmup": "critic_warmup",
    },
}
MOVED = {
    f"{group.split('.')[0]}.{old}": f"{group}.{field}"
    for group, fields in _GROUPS.items()
    for field, old in fields.items()
}


def plain_key(key: str) -> str:
    """A dotted config key without its ``init_args`` levels (``data.init_args.x`` -> ``data.x``)."""
    return ".".join(part for part in key.split(".") if part != "init_args")


def refuse_moved(keys, where: str) -> None:
    """Raise ``ConfigError`` for the first of ``keys`` (dotted, from YAML or the command line) that
    moved into a group, naming its new key."""
    for key in keys:
        moved = MOVED.get(plain_key(key))
        if moved is not None:
            raise ConfigError(
                f"{plain_key(key)} (in {where}) is now {moved}: write it there (docs/config.md, Moved settings)"
            )


def regroup_moved(section: str, settings: dict) -> dict:
    """``settings`` of one section (a checkpoint's saved hyperparameters) with keys saved before a
    move put into their groups, so runs saved earlier still load."""
    out = dict(settings)
    for old, new in MOVED.items():
        head, name = old.split(".", 1)
        if head == section and name in out and not isinstance(out[name], dict):  # a dict: the group itself
            group, field = new.split(".")[1:]
            value = out.pop(name)
            out[group] = {**(out.get(group) or {}), field: value}
    return out


def ungroup_moved(section: str, settings: dict) -> dict:
    """``regroup_moved`` undone: ``settings`` of one section with each moved setting under its name
    before the move. For identities computed from settings (a grid's cell and stage names), which
    must not change when a setting only moves into a group."""
    out, named_as_group = dict(settings), {}  # a setting named as its group (``critic``) is put back last
    for old, new in MOVED.items():
        head, name = old.split(".", 1)
        group, field = new.split(".")[1:]
        if head == section and isinstance(out.get(group), dict) and field in out[group]:
            rest = dict(out[group])
            (named_as_group if name == group else out)[name] = rest.pop(field)
            if rest:
                out[group] = rest
            else:
                del out[group]
    return {**out, **named_as_group}


def current_key(key: str) -> str:
    """A dotted config key written as today: a moved setting's old key as its new one
    (``data.init_args.top_k`` -> ``data.init_args.sampling.top_k``); any other key as it is."""
    after = MOVED.get(plain_key(key))
    if after is None:
        return key
    head, rest = after.split(".", 1)
    return f"{head}.init_args.{rest}" if ".init_args." in key else after


def pre_move_key(key: str) -> str:
    """A dotted config key written as before its setting moved (``data.init_args.sampling.top_k`` ->
    ``data.init_args.top_k``); any other key as it is."""
    before = {new: old for old, new in MOVED.items()}.get(plain_key(key))
    if before is None:
        return key
    head, name = before.split(".", 1)
    return f"{head}.init_args.{name}" if ".init_args." in key else before
