"""Named task sets: the cache lock every environment's named sets are generated under, and a named
set's expert play as demonstrations. Each environment knows its own sets (``Game.task_sets`` and
its ``load_tasks``):

- ``textworld:<complexity>:<split>:<count>``: generated TextWorld games (``envs/textworld/games.py``);
- ``alfworld:<split>:<count>``: the project's ALFWorld games, ``count`` per task type, and
  ``alfworld-data:<split>[:<count>]``: the official ones under ``$ALFWORLD_DATA``
  (``envs/alfworld/games.py``);
- ``swe:bundled:<split>``: the bundled SWE repositories, and ``swe:<file>``: a local SWE-Gym
  instance file read with ``datasets`` (``envs/swe/instances.py``);
- anything else is a file path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.envs.base import REGISTRY, Env
from lit_marl.models import cache_dir
from lit_marl.tasks import write_atomic

DEMO_FORMAT = 2
"""Raise it when what an environment renders changes (observation text, command format): cached
walkthrough demonstrations written by an older version are then written again."""


def family(source: str | None, env: Env | None = None) -> str | None:
    """The named-set head of ``source`` that ``env`` (default: any registered game) knows, or None."""
    head = (source or "").split(":", 1)[0]
    if ":" not in (source or ""):
        return None
    games = [env] if env is not None else list(REGISTRY.values())
    known = {head for game in games for head in game.task_sets}
    return head if head in known else None


def named_set(source: str, field: str, resolve: Callable[[str, str], str]) -> str:
    """A named set's task file, made by ``resolve(source, field)`` (its games generated once, cached).
    The ranks of a node take turns (a lock file in the cache): the first generates, the others then
    find every game cached, so a set is generated once per node, not once per rank."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{source.split(':', 1)[0]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return resolve(source, field)


def resolve_source(source: str, field: str = "data.train_path") -> str:
    """A task file path as it is, or the task file of a named set of a registered game."""
    kind = family(source)
    if kind is None:
        return source
    game = next(c for c in REGISTRY.values() if kind in c.task_sets)
    return named_set(source, field, game.resolve_set)


def same_games(source: str, other: str) -> bool:
    """Whether two named sources draw from the same games: the same family and the same
    complexity and split (TextWorld) or split (ALFWorld); counts differ only in how many."""
    a, b = source.split(":"), other.split(":")
    key = 3 if a[0] in ("textworld", "swe") else 2
    return family(source) == family(other) and a[:key] == b[:key]


def resolve_demo_source(
    source: str,
    env: Env,
    env_name: str,
    env_kwargs: dict | None,
    disjoint_from: dict[str, str | None],
    field: str = "data.demos.path",
) -> str:
    """A demonstrations file as it is, or the walkthroughs of a named game set played by ``env``
    (the data module's own environment, so the observations are exactly those an RL episode
    renders), written once beside the set's task file as ``<task file>.<env>-<key>.demos.jsonl``,
    the key hashing the env's name and settings, ``DEMO_FORMAT``, the game packages' versions and
    the task rows; returns that file. A game whose walkthrough does not win is an error, never a
    demonstration; so is a set whose games a source of ``disjoint_from`` (field -> source: the run's
    train and val tasks) names too, or an env that does not play the set's games."""
    kind = family(source)
    if kind is None:
        return source
    for other_field, other in disjoint_from.items():
        if kind == "swe" and other_field == "data.train_path":
            continue  # SWE: SFT on the training instances' known fixes, then RL on them (held out: val)
        if other and family(other) and same_games(source, other):
            raise ConfigError(
                f"{field}={source!r} draws from the games of {other_field}={other!r}: take the "
                "demonstrations from another split (the guide's: validation)"
            )
    if kind not in env.task_sets:
        raise ConfigError(
            f"{field}={source!r} names {kind} walkthroughs, but data.env={env_name!r} does not play them: "
            f"give a demonstrations file (scripts/make_demos.py) or an environment that plays the {kind} set"
        )
    tasks_file = Path(resolve_source(source, field))
    rows = [json.loads(line) for line in tasks_file.read_text().splitlines() if line.strip()]
    settings = [env_name, env_kwargs or {}, DEMO_FORMAT, [version(p) for p in env.demo_packages], rows]
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    out = tasks_file.with_name(f"{tasks_file.stem}.{env_name}-{key}.demos.jsonl")
    if out.is_file():
        return str(out)
    lines = []
    for index, row in enumerate(rows):
        group = row.get("task_type") or source.split(":")[1]  # ALFWorld: the task type; TextWorld: complexity
        task_id = f"{group}/{row['seed']}" if "seed" in row else f"{source}#{index}"
        try:
            messages = env.demonstration(row)
        except ValueError as err:
            raise ConfigError(f"{field}={source!r}: game {task_id} ({row.get('game')}): {err}") from err
        demo = {"task_id": task_id, "env": env_name, "messages": messages}
        if "task_type" in row:  # data.task_types filters demonstrations by it too
            demo["task_type"] = row["task_type"]
        lines.append(json.dumps(demo) + "\n")
    write_atomic(out, "".join(lines))
    return str(out)
