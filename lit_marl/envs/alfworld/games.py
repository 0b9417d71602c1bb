"""ALFWorld's household tasks as TextWorld tw-pddl games: the project's own generated games, and
the official ones where a user has them (``$ALFWORLD_DATA``).

The ``alfworld`` package ships the PDDL domain and the text grammar (``alfred.pddl``,
``alfred.twl2``) but no game; its download needs the network. So games are written here against
that domain and grammar, the way ALFWorld's own generator writes them: a PDDL problem (receptacles
at locations, objects in receptacles, what each object affords - ALFRED's tables in
``alfworld.gen.constants``), the goal of the task type from ``alfworld.gen.goal_library`` and its
templated task sentence, in the layout ``alfworld-download`` produces
(``<split>/<task dir>/<trial>/game.tw-pddl`` beside a ``traj_data.json``). Each game's walkthrough
is the planner's plan (Fast Downward, through TextWorld's PDDL backend), checked to win when the
game is written; a game whose plan does not win is never written.

Named sets (``resolve_source``):
- ``alfworld:<split>:<count>``: ``count`` generated games of every task type from the seed range of
  ``split`` (train / validation / test, disjoint, as for TextWorld), written once and cached.
- ``alfworld-data:<split>[:<count>]``: the official games of ``$ALFWORLD_DATA/json_2.1.1/<split>``
  (train / valid_seen / valid_unseen), the first ``count`` of each task type (all without it); like
  ALFWorld, games marked unsolvable and the movable-receptacle and sliced-object tasks are left out.

Task rows are ``{"game": "<path>/game.tw-pddl", "task_type": ...}``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.envs.textworld.games import split_seeds
from lit_marl.models import cache_dir
from lit_marl.tasks import write_atomic

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
ALIASES = {name.removesuffix("_in_recep"): name for name in TASK_TYPES}
"""Short names (``pick_clean_then_place``) for the official ones."""

GENERATOR_VERSION = 2
"""Raise it when what a generated game holds changes: cached games are then written again."""

OFFICIAL_SPLITS = ("train", "valid_seen", "valid_unseen")

# the receptacles of each room kind (ALFRED's scenes, fewer of them); the task types that need an
# appliance get it in any room
ROOMS = {
    "Kitchen": (
        "CounterTop", "Cabinet", "Drawer", "Fridge", "Microwave", "SinkBasin", "StoveBurner",
        "DiningTable", "Shelf", "GarbageCan", "CoffeeMachine", "Toaster",
    ),
    "Bedroom": ("Bed", "Desk", "Dresser", "SideTable", "Shelf", "Drawer", "GarbageCan", "Safe", "ArmChair"),
    "LivingRoom": (
        "Sofa", "ArmChair", "CoffeeTable", "SideTable", "TVStand", "Drawer", "Cabinet", "Shelf", "GarbageCan",
        "Dresser",
    ),
    "Bathroom": ("CounterTop", "Cabinet", "Drawer", "SinkBasin", "Toilet", "GarbageCan", "Shelf", "BathtubBasin"),
}  # fmt: skip
APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
AFFORDANCE = {  # the property the task's object must have (ALFRED's VAL_ACTION_OBJECTS key)
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
LAMP_HOSTS = ("Desk", "Dresser", "SideTable")
# objects that are receptacles in ALFRED's tables but only objects here (no nesting)
_NESTING = {"Bowl", "Box", "Cup", "Mug", "Pan", "Plate", "Pot"}


def task_type(name: str, field_name: str) -> str:
    """The official name of a task type (the short forms accepted), or a ConfigError naming the field."""
    canonical = ALIASES.get(name, name)
    if canonical not in TASK_TYPES:
        raise ConfigError(f"{field_name}: unknown ALFWorld task type {name!r}; choose from {list(TASK_TYPES)}")
    return canonical


# ---------------------------------------------------------------------- scenes
@dataclass
class Scene:
    """One household task: receptacles (ALFRED type each), objects in them, and the task's targets."""

    task_type: str
    room: str
    receptacles: list[str] = field(default_factory=list)  # ALFRED ids "Type|x|y|z"
    objects: list[tuple[str, str]] = field(default_factory=list)  # (ALFRED id, receptacle id)
    target: str = ""  # object type
    recep: str = ""  # goal receptacle type ("" for look_at_obj_in_light)
    toggle: str = ""  # the lamp's type for look_at_obj_in_light


def _type_of(alfred_id: str) -> str:
    parts = alfred_id.split("|")
    return parts[-1] if parts[-1].endswith("Basin") else parts[0]


def _mangle(alfred_id: str) -> str:
    """ALFRED's id as a PDDL name (its own escapes, so ALFWorld's demangler reads it back)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        alfred_id = alfred_id.replace(old, new)
    return alfred_id


def _constants():
    # deferred: the alfworld package is needed only when a game is written
    from alfworld.gen import constants

    return constants


def make_scene(kind: str, seed: int) -> Scene:
    """A seeded scene for task type ``kind``: 4-7 receptacles of a room that ALFRED allows for the
    task (its appliance included), the target object(s) where they can stand but not already where
    the goal wants them, and 2-4 other objects."""
    for attempt in range(100):  # a draw of receptacles may leave no object a place to go: draw again
        scene = _draw_scene(kind, random.Random(f"alfworld:{kind}:{seed}:{attempt}"))
        if scene is not None:
            return scene
    raise RuntimeError(f"no {kind} scene for seed {seed} in 100 draws")


def _draw_scene(kind: str, rng: random.Random) -> Scene | None:
    c = _constants()
    holds = {r: set(objs) - {o for o in objs if "Sliced" in o} for r, objs in c.VAL_RECEPTACLE_OBJECTS.items()}
    room = rng.choice(sorted(c.GOALS_VALID[kind]))
    pool = [r for r in ROOMS[room] if r in holds]
    needed = [APPLIANCE[kind]] if kind in APPLIANCE else []
    if kind == "look_at_obj_in_light":
        needed.append(rng.choice([r for r in LAMP_HOSTS if r in pool] or list(LAMP_HOSTS)))
    others = [r for r in pool if r not in needed]
    types = needed + rng.sample(others, rng.randint(4, 7) - len(needed))
    types += [t for t in ("Cabinet", "Drawer") if t in types and rng.random() < 0.5]  # a second one
    scene = Scene(kind, room)
    used: set[str] = set()

    def new_id(kind_name: str) -> str:
        while True:
            x, y, z = (rng.uniform(-3, 3) for _ in range(3))
            ident = f"{kind_name}|{x:+06.2f}|{y:+06.2f}|{z:+06.2f}"
            if ident not in used:
                used.add(ident)
                return ident

    for t in types:
        if t.endswith("Basin"):  # ALFRED: "Sink|x|y|z|SinkBasin", which ALFWorld names "sinkbasin"
            scene.receptacles.append(new_id(t.removesuffix("Basin")) + f"|{t}")
        else:
            scene.receptacles.append(new_id(t))
    present = {_type_of(r) for r in scene.receptacles}
    lamps = c.VAL_ACTION_OBJECTS["Toggleable"]
    objects = sorted(set().union(*holds.values()) - _NESTING - set(c.VAL_RECEPTACLE_OBJECTS) - lamps)
    if kind in AFFORDANCE:
        objects = [o for o in objects if o in c.VAL_ACTION_OBJECTS[AFFORDANCE[kind]]]
    appliance = APPLIANCE.get(kind)
    candidates = []  # (object, goal receptacle type, start receptacles)
    for obj in objects:
        for goal in sorted(present - {appliance}):
            if obj not in holds[goal] and kind != "look_at_obj_in_light":
                continue
            starts = [r for r in scene.receptacles if obj in holds[_type_of(r)] and _type_of(r) != goal]
            if kind == "look_at_obj_in_light":
                starts = [r for r in scene.receptacles if obj in holds[_type_of(r)]]
            if starts:
                candidates.append((obj, "" if kind == "look_at_obj_in_light" else goal, starts))
    if not candidates:
        return None
    obj, goal, starts = rng.choice(sorted({(o, g, tuple(s)) for o, g, s in candidates}))
    scene.target, scene.recep = obj, goal
    for _ in range(2 if kind == "pick_two_obj_and_place" else 1):
        scene.objects.append((new_id(obj), rng.choice(starts)))
    if kind == "look_at_obj_in_light":
        scene.toggle = "DeskLamp"
        host = next(r for r in scene.receptacles if _type_of(r) in LAMP_HOSTS)
        scene.objects.append((new_id("DeskLamp"), host))
    for _ in range(rng.randint(2, 4)):
        other = rng.choice([o for o in objects if o != obj] or [o for o in sorted(holds["CounterTop"]) if o != obj])
        # a distractor never satisfies the goal's receptacle test with the target's type
        places = [r for r in scene.receptacles if other in holds[_type_of(r)]]
        if places:
            scene.objects.append((new_id(other), rng.choice(places)))
    return scene


def problem_text(scene: Scene) -> str:
    """The scene as a PDDL problem of ALFWorld's ``alfred`` domain, the task type's goal included."""
    c = _constants()
    from alfworld.gen import goal_library  # deferred with the package (see _constants)

    receptacle_types = {_type_of(r) for r in scene.receptacles} | {"SinkBasin", "Microwave", "Fridge"}
    object_types = {_type_of(o) for o, _ in scene.objects} | {"Knife", "ButterKnife"}  # the domain names them
    lines = ["(define (problem plan_lit_marl)", "(:domain alfred)", "(:objects", "    agent1 - agent"]
    lines += [f"    {t}Type - otype" for t in sorted(object_types)]
    lines += [f"    {t}Type - rtype" for t in sorted(receptacle_types)]
    lines += [f"    {_mangle(o)} - object" for o, _ in scene.objects]
    lines += [f"    {_mangle(r)} - receptacle" for r in scene.receptacles]
    lines += ["    loc_bar_start - location"] + [f"    loc_bar_{i} - location" for i in range(len(scene.receptacles))]
    lines += [")", "(:init", "    (atLocation agent1 loc_bar_start)"]
    where = {r: f"loc_bar_{i}" for i, r in enumerate(scene.receptacles)}
    for r in scene.receptacles:
        kind = _type_of(r)
        name = _mangle(r)
        lines += [f"    (receptacleType {name} {kind}Type)", f"    (receptacleAtLocation {name} {where[r]})"]
        if kind in c.OPENABLE_CLASS_LIST:
            lines.append(f"    (openable {_mangle(r)})")
    for o, r in scene.objects:
        kind = _type_of(o)
        lines += [
            f"    (objectType {_mangle(o)} {kind}Type)",
            f"    (inReceptacle {_mangle(o)} {_mangle(r)})",
            f"    (objectAtLocation {_mangle(o)} {where[r]})",
        ]
        if kind in c.VAL_ACTION_OBJECTS["Toggleable"]:
            lines.append(f"    (toggleable {_mangle(o)})")
        else:
            lines.append(f"    (pickupable {_mangle(o)})")
        for affordance, predicate in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if kind in c.VAL_ACTION_OBJECTS[affordance]:
                lines.append(f"    ({predicate} {_mangle(o)})")
    holds = c.VAL_RECEPTACLE_OBJECTS
    for r_type in sorted({_type_of(r) for r in scene.receptacles}):
        for o_type in sorted({_type_of(o) for o, _ in scene.objects}):
            if o_type in holds.get(r_type, ()):
                lines.append(f"    (canContain {r_type}Type {o_type}Type)")
    lines.append(")")
    goal = goal_library.gdict[scene.task_type]["pddl"]
    lines.append(goal.format(obj=scene.target, recep=scene.recep, toggle=scene.toggle, mrecep="").replace("#", "-"))
    return "\n".join(lines) + "\n"


def task_sentence(scene: Scene, seed: int) -> str:
    """ALFWorld's templated task description (``get_templated_task_desc``), its template drawn
    from this game's own seed rather than the global ``random``."""
    from alfworld.gen import goal_library  # deferred with the package (see _constants)

    template = random.Random(f"alfworld-task:{seed}").choice(goal_library.gdict[scene.task_type]["templates"])
    return template.format(obj=scene.target.lower(), recep=scene.recep.lower(), toggle=scene.toggle.lower(), mrecep="")


def traj_data(scene: Scene) -> dict:
    """The part of ALFRED's ``traj_data.json`` that ALFWorld's loaders read."""
    params = {"object_target": scene.target, "parent_target": scene.recep, "toggle_target": scene.toggle}
    return {"task_type": scene.task_type, "pddl_params": {**params, "mrecep_target": "", "object_sliced": False}}


def game_data(scene: Scene, seed: int) -> dict:
    """The tw-pddl JSON of a scene, without its walkthrough (``with_walkthrough`` adds it)."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH  # deferred with the package

    grammar = Path(ALFRED_TWL2_PATH).read_text().replace("UNKNOWN GOAL", task_sentence(scene, seed))
    return {
        "pddl_domain": Path(ALFRED_PDDL_PATH).read_text(),
        "grammar": grammar,
        "pddl_problem": problem_text(scene),
        "solvable": None,
        "walkthrough": None,
    }


def task_dir_name(scene: Scene, seed: int) -> str:
    """ALFRED's folder name: ``<type>-<object>-<toggle or None>-<receptacle or None>-<scene>``."""
    return f"{scene.task_type}-{scene.target}-{scene.toggle or 'None'}-{scene.recep or 'None'}-{seed}"


def write_game(kind: str, seed: int, root: Path) -> dict:
    """Generate, plan, check and write one game under ``root``; its task row. Already written: read."""
    scene = make_scene(kind, seed)
    folder = root / task_dir_name(scene, seed) / f"trial_{seed}"
    path = folder / "game.tw-pddl"
    row = {"game": str(path), "task_type": kind, "seed": seed}
    if path.is_file():
        return row
    folder.mkdir(parents=True, exist_ok=True)
    data = game_data(scene, seed)
    partial = folder / f".plan.{os.getpid()}.tw-pddl"
    partial.write_text(json.dumps(data))
    try:
        walkthrough = plan_and_check(partial)
    finally:
        partial.unlink(missing_ok=True)
    data.update(solvable=True, walkthrough=walkthrough)
    write_atomic(folder / "traj_data.json", json.dumps(traj_data(scene)))
    write_atomic(path, json.dumps(data))
    return row


def start_game(path: str, admissible_commands: bool = False, policy_commands: bool = False, facts: bool = False):
    """A tw-pddl game through TextWorld's PDDL backend with ALFWorld's wrappers: object names as
    ALFWorld shows them ("apple 1"), the game file among the infos (and, with ``facts``, the PDDL
    facts that hold: the game's state)."""
    import textworld  # deferred: 0.6 s of start-up that runs which never play it skip
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    infos = textworld.EnvInfos(
        won=True,
        feedback=True,
        admissible_commands=admissible_commands,
        policy_commands=policy_commands,
        facts=facts,
        extras=["gamefile"],
    )
    return textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])


def plan_and_check(path: Path) -> list[str]:
    """The planner's plan of a game, replayed in a fresh game: it must win there (and not before)."""
    game = start_game(str(path), policy_commands=True)
    plan = list(game.reset()["policy_commands"] or [])
    if not plan:
        raise ValueError(f"{path}: the planner found no plan")
    state = game.reset()  # the same game from its start (a reset is ~30 ms, a load ~170 ms)
    for t, command in enumerate(plan):
        if state["won"]:
            raise ValueError(f"{path}: won before the plan's step {t + 1}")
        state, _, _ = game.step(command)
    if not state["won"]:
        raise ValueError(f"{path}: the planner's plan {plan} does not win")
    return plan


def _write_one(job: tuple[str, int, str]) -> dict:
    kind, seed, root = job
    return write_game(kind, seed, Path(root))


def write_tasks(split: str, count: int, root: Path, workers: int = 1, kinds: tuple[str, ...] = TASK_TYPES) -> Path:
    """``count`` games of each task type from ``split``'s seeds under ``root/<split>`` (in
    ``workers`` processes), and the task file listing them (written last: it exists only when every
    game does)."""
    subset = "" if tuple(kinds) == TASK_TYPES else "-" + "+".join(kinds)
    out = root / f"{split}-{count}{subset}.jsonl"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:  # concurrent writers (ranks, test workers): one works
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            _write_set(out, split, count, root, workers, kinds)
    return out


def _write_set(out: Path, split: str, count: int, root: Path, workers: int, kinds: tuple[str, ...]) -> None:
    seeds = split_seeds(split, count)
    jobs = [(kind, seed, str(root / split)) for kind in kinds for seed in seeds]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_write_one, jobs))  # in the jobs' order
    else:
        rows = [_write_one(job) for job in jobs]
    write_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))


def default_root() -> Path:
    """Where generated games live: ``$LIT_MARL_CACHE/alfworld/generated-v<GENERATOR_VERSION>``."""
    return cache_dir() / "alfworld" / f"generated-v{GENERATOR_VERSION}"


# ---------------------------------------------------------------------- the official games
def official_tasks(data: Path, split: str, count: int | None = None, field_name: str = "data.train_path") -> list[dict]:
    """Task rows of the official games of one split under ``data`` (``$ALFWORLD_DATA``), sorted,
    the first ``count`` of each task type; left out as ALFWorld leaves them out: unsolvable games,
    movable-receptacle and sliced-object tasks."""
    if split not in OFFICIAL_SPLITS:
        raise ConfigError(f"{field_name}: ALFWorld split {split!r}; choose one of {list(OFFICIAL_SPLITS)}")
    folder = data / "json_2.1.1" / split
    if not folder.is_dir():
        raise ConfigError(
            f"{field_name}: no ALFWorld games at {folder} (ALFWORLD_DATA={str(data)!r}); the layout is "
            "what `alfworld-download` writes ($ALFWORLD_DATA/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl)"
        )
    rows, per_type = [], {}
    for traj in sorted(folder.glob("*/*/traj_data.json")):
        game = traj.with_name("game.tw-pddl")
        if "movable" in str(traj.parent) or "Sliced" in str(traj.parent) or not game.is_file():
            continue
        kind = json.loads(traj.read_text())["task_type"]
        if kind not in TASK_TYPES or not json.loads(game.read_text()).get("solvable", False):
            continue
        if count is not None and per_type.get(kind, 0) >= count:
            continue
        per_type[kind] = per_type.get(kind, 0) + 1
        rows.append({"game": str(game), "task_type": kind})
    if not rows:
        raise ConfigError(f"{field_name}: no playable ALFWorld game under {folder}")
    return rows


def resolve_source(source: str, field_name: str = "data.train_path") -> str:
    """A task file path as it is; ``alfworld:<split>:<count>`` (generated) or
    ``alfworld-data:<split>[:<count>]`` (official, from ``$ALFWORLD_DATA``): its task file's path."""
    parts = source.split(":")
    if parts[0] == "alfworld":
        if len(parts) != 3 or not parts[2].isdigit() or int(parts[2]) < 1:
            raise ConfigError(
                f"{field_name}={source!r}: name generated games as alfworld:<split>:<count per task type>"
            )
        try:
            split_seeds(parts[1], int(parts[2]))
        except ConfigError as err:
            raise ConfigError(f"{field_name}={source!r}: {err}") from None
        workers = min(os.cpu_count() or 1, 4)
        return str(write_tasks(parts[1], int(parts[2]), default_root(), workers))
    if parts[0] == "alfworld-data":
        if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
            raise ConfigError(f"{field_name}={source!r}: name official games as alfworld-data:<split>[:<count>]")
        data = os.environ.get("ALFWORLD_DATA")
        if not data:
            raise ConfigError(f"{field_name}={source!r}: set ALFWORLD_DATA to the folder alfworld-download wrote")
        rows = official_tasks(Path(data), parts[1], int(parts[2]) if len(parts) == 3 else None, field_name)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        out = cache_dir() / "alfworld" / f"official-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.is_file():
            write_atomic(out, text)
        return str(out)
    return source
