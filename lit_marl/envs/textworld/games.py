"""TextWorld games generated offline, by complexity and seed, cached by their parameters.

A complexity is ``wW-oO-qQ`` (optionally ``-bB``): a ``custom`` game with W rooms, O objects and a
quest of Q steps (breadth B), or ``tw-simple-<rewards>`` with rewards ``sparse``, ``balanced`` or
``dense`` (TextWorld's fixed six-room "simple" game; eating the food loses). A game is the file
``<root>/<complexity>/<seed>.z8``: generated once, reused afterwards. Seeds come in disjoint
ranges per split (the guide's: train 50001-55000, validation 40001-40100, test 1-100), so no
held-out game is ever trained on.

``scripts/make_textworld_games.py`` writes a task JSONL per split whose rows are
``{"game": "<path>.z8", "complexity": ..., "seed": ..., "split": ...}``.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.models import cache_dir
from lit_marl.tasks import write_atomic

SPLITS: dict[str, tuple[int, int]] = {"train": (50001, 55000), "validation": (40001, 40100), "test": (1, 100)}
"""The guide's seed range (inclusive) of each split."""

GUIDE_COMPLEXITIES = (
    "w2-o3-q4",  # base
    "w8-o3-q4",  # spatial
    "w2-o12-q4",  # object
    "w8-o12-q4",
    "w4-o6-q8",
    "tw-simple-dense",
    "tw-simple-balanced",
    "tw-simple-sparse",
)

_CUSTOM = re.compile(r"^w(\d+)-o(\d+)-q(\d+)(?:-b(\d+))?$")
_SIMPLE = re.compile(r"^tw-simple-(sparse|balanced|dense)$")


@dataclass(frozen=True)
class Complexity:
    """What a game set's name says: a custom world's sizes, or tw-simple's reward mode."""

    name: str
    rooms: int = 0
    objects: int = 0
    quest_length: int = 0
    quest_breadth: int = 1
    simple_rewards: str | None = None

    @staticmethod
    def parse(name: str, field: str = "complexity") -> "Complexity":
        custom = _CUSTOM.match(name)
        if custom:
            rooms, objects, length, breadth = (int(g) if g else 1 for g in custom.groups())
            if min(rooms, length, breadth) < 1:
                raise ConfigError(f"{field}={name!r}: world size, quest length and breadth must be at least 1")
            return Complexity(name, rooms, objects, length, breadth)
        simple = _SIMPLE.match(name)
        if simple:
            return Complexity(name, simple_rewards=simple.group(1))
        raise ConfigError(
            f"{field}={name!r}: not a complexity; give wW-oO-qQ (e.g. w2-o3-q4, optionally -bB for the quest breadth) "
            "or tw-simple-sparse / tw-simple-balanced / tw-simple-dense"
        )


def check_seed_ranges(ranges: dict[str, tuple[int, int]], field: str = "seeds") -> None:
    """Each split's (first, last) seeds: non-empty, positive, and no two splits overlapping."""
    for split, (first, last) in ranges.items():
        if not 0 < first <= last:
            raise ConfigError(f"{field}[{split!r}]=({first}, {last}): give 0 < first <= last")
    items = sorted(ranges.items(), key=lambda item: item[1])
    for (a, (_, a_last)), (b, (b_first, _)) in zip(items, items[1:]):
        if b_first <= a_last:
            raise ConfigError(
                f"{field}: the seeds of {a!r} and {b!r} overlap (up to {a_last} and from {b_first}); a game of one "
                "split would be a game of the other"
            )


def split_seeds(split: str, count: int, ranges: dict[str, tuple[int, int]] | None = None) -> list[int]:
    """The first ``count`` seeds of ``split``'s range."""
    ranges = dict(SPLITS if ranges is None else ranges)
    check_seed_ranges(ranges)
    if split not in ranges:
        raise ConfigError(f"split={split!r}: choose one of {sorted(ranges)}")
    first, last = ranges[split]
    if count > last - first + 1:
        raise ConfigError(f"count={count}: split {split!r} has only {last - first + 1} seeds ({first}-{last})")
    return list(range(first, first + count))


def game_path(root: str | Path, complexity: str, seed: int) -> Path:
    return Path(root) / complexity / f"{seed}.z8"


def make_game(complexity: str, seed: int, root: str | Path) -> Path:
    """The game of ``complexity`` and ``seed`` under ``root``, generated (and compiled) unless it exists."""
    spec = Complexity.parse(complexity)
    path = game_path(root, complexity, seed)
    if path.exists() and path.with_suffix(".json").exists():
        return path
    # deferred: importing textworld costs 0.6 s of start-up that runs which never play it skip
    import textworld
    import textworld.challenges
    import textworld.generator

    path.parent.mkdir(parents=True, exist_ok=True)
    options = textworld.GameOptions()
    options.seeds = seed
    options.path = str(path)
    options.file_ext = ".z8"
    options.force_recompile = True
    if spec.simple_rewards is None:
        options.nb_rooms, options.nb_objects = spec.rooms, spec.objects
        options.quest_length, options.quest_breadth = spec.quest_length, spec.quest_breadth
        game = textworld.generator.make_game(options)
    else:
        make = textworld.challenges.CHALLENGES["tw-simple"][1]
        game = make({"rewards": spec.simple_rewards, "goal": "detailed", "test": False}, options)
    # compiled under a name of this process's own, then renamed: a killed run leaves no half-written
    # game behind, and two processes making the same game (two test workers) never share a file
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.z8")
    options.path = str(partial)
    compiled = Path(textworld.generator.compile_game(game, options))
    compiled.with_suffix(".json").replace(path.with_suffix(".json"))
    compiled.replace(path)
    for leftover in path.parent.glob(f".{path.stem}.{os.getpid()}.partial.*"):  # the Inform 7 source
        leftover.unlink(missing_ok=True)
    return path


def _make(args: tuple[str, int, str]) -> str:
    return str(make_game(*args))


def make_games(complexity: str, seeds: list[int], root: str | Path, workers: int = 1) -> tuple[list[Path], float]:
    """Every seed's game (the cached ones are not regenerated), in ``workers`` processes; returns
    the paths in seed order and the seconds it took."""
    Complexity.parse(complexity)
    start = time.perf_counter()
    jobs = [(complexity, seed, str(root)) for seed in seeds]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            paths = [Path(p) for p in pool.map(_make, jobs)]
    else:
        paths = [Path(_make(job)) for job in jobs]
    return paths, time.perf_counter() - start


def write_tasks(
    complexity: str,
    split: str,
    count: int,
    root: str | Path,
    workers: int = 1,
    ranges: dict | None = None,
    name: str | None = None,
) -> Path:
    """Generate ``count`` games of ``split`` and write their task rows to
    ``<root>/<complexity>/<name or split>.jsonl``; returns that file."""
    seeds = split_seeds(split, count, ranges)
    paths, _ = make_games(complexity, seeds, root, workers)
    out = Path(root) / complexity / f"{name or split}.jsonl"
    rows = [
        {"game": str(path.resolve()), "complexity": complexity, "seed": seed, "split": split}
        for path, seed in zip(paths, seeds)
    ]
    write_atomic(out, "".join(json.dumps(row) + "\n" for row in rows))
    return out


def default_root() -> Path:
    """Where named game sets are generated: ``$LIT_MARL_CACHE/textworld`` (default ``~/.cache/lit_marl``)."""
    return cache_dir() / "textworld"


def resolve_source(source: str, field: str = "data.train_path", workers: int | None = None) -> str:
    """A task file path as it is, or a named game set ``textworld:<complexity>:<split>:<count>``
    generated (once, cached) under ``default_root()``: its task file's path. Made ahead of a run by
    ``scripts/make_textworld_games.py --config``."""
    if not source.startswith("textworld:"):
        return source
    complexity, split, count = game_set(source, field)
    # a file per count: runs naming other counts of the same split never overwrite each other's rows
    workers = workers or min(os.cpu_count() or 1, 4)
    return str(write_tasks(complexity, split, count, default_root(), workers, name=f"{split}-{count}"))


def game_set(source: str, field: str) -> tuple[str, str, int]:
    """``textworld:<complexity>:<split>:<count>`` -> (complexity, split, count), each checked."""
    parts = source.split(":")
    if len(parts) != 4 or not parts[3].isdigit() or int(parts[3]) < 1:
        raise ConfigError(
            f"{field}={source!r}: name a game set as textworld:<complexity>:<split>:<count> (a count of at least 1)"
        )
    _, complexity, split, count = parts
    Complexity.parse(complexity, field)
    try:
        split_seeds(split, int(count))
    except ConfigError as err:
        raise ConfigError(f"{field}={source!r}: {err}") from None
    return complexity, split, int(count)
