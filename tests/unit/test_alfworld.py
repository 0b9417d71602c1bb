"""ALFWorld: the project's generated tw-pddl games, the env, the official-data loader, task-type
mixtures and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from lit_marl import ConfigError
from lit_marl.envs import make_env
from lit_marl.envs.alfworld import AlfWorldEnv
from lit_marl.envs.alfworld import games as g
from lit_marl.envs.alfworld.env import to_current_syntax
from lit_marl.envs.sources import resolve_demo_source, resolve_source
from lit_marl.envs.textworld.games import SPLITS, split_seeds
from lit_marl.tasks import mixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def rows():
    """Two generated games of every task type (test seeds 1 and 2), written once per run."""
    path = resolve_source("alfworld:test:2")
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def play(env: AlfWorldEnv, task: dict, commands: list[str]):
    first = env.start(task)
    result = None
    for command in commands:
        result = env.act([command])
        if result.terminated:
            break
    return first, result


def test_two_games_of_every_task_type_each_won_by_its_plan_alone(rows):
    assert sorted({r["task_type"] for r in rows}) == sorted(g.TASK_TYPES)
    assert all(sum(r["task_type"] == kind for r in rows) == 2 for kind in g.TASK_TYPES)
    env = AlfWorldEnv()
    for row in rows:
        plan = [turn[0] for turn in env.expert_turns(row)]
        first, result = play(env, row, plan)
        assert first[0].startswith("You are in the middle of a room. Looking quickly around you, you see ")
        assert "Your task is to: " in first[0] and "Welcome to TextWorld" not in first[0]
        assert result.terminated and result.info == {"won": True, "lost": False, "score": 1, "max_score": 1}, row
        # the plan's last step is what wins: without it the game goes on
        _, short = play(env, row, plan[:-1])
        assert not short.info["won"] and not short.terminated, row


def test_wrong_plans_do_not_win(rows):
    """Skipping the task's state change (clean / heat / cool), placing the object elsewhere, looking
    without the lamp, or bringing one of two objects: no win."""
    env = AlfWorldEnv()
    for row in rows:
        plan = [turn[0] for turn in env.expert_turns(row)]
        kind = row["task_type"]
        wrong = [c for c in plan if c.split()[0] not in ("clean", "heat", "cool", "use")]
        if kind == "pick_two_obj_and_place":
            wrong = plan[: plan.index(next(c for c in plan if c.startswith("move"))) + 1]
        elif kind == "pick_and_place_simple":  # the object into another receptacle of the room
            obj, target = plan[-1].removeprefix("move ").split(" to ")
            room = env.start(row)[0].split("you see ")[1].split("\n")[0]
            elsewhere = next(r for r in re.findall(r"\ba ([a-z]+ \d+)", room) if r.split()[0] != target.split()[0])
            wrong = plan[:-2] + [f"go to {elsewhere}", f"open {elsewhere}", f"move {obj} to {elsewhere}"]
        _, result = play(env, row, wrong)
        assert not result.info["won"], (kind, wrong)


def test_the_old_put_syntax_is_mapped_to_move(rows):
    assert to_current_syntax("put apple 1 in on fridge 1") == "move apple 1 to fridge 1"  # "in/on", sanitized
    assert to_current_syntax("put mug 2 in cabinet 1") == "move mug 2 to cabinet 1"
    assert to_current_syntax("put book 1 on desk 1") == "move book 1 to desk 1"
    assert to_current_syntax("take apple 1 from fridge 1") == "take apple 1 from fridge 1"
    env = AlfWorldEnv()
    row = next(r for r in rows if r["task_type"] == "pick_and_place_simple")
    plan = [turn[0] for turn in env.expert_turns(row)]
    old = [c.replace("move ", "put ").replace(" to ", " in/on ") if c.startswith("move ") else c for c in plan]
    assert old != plan
    _, result = play(env, row, old)
    assert result.info["won"]


def test_generated_games_are_deterministic_and_the_splits_disjoint(tmp_path):
    for kind in g.TASK_TYPES:
        assert g.game_data(g.make_scene(kind, 7), 7) == g.game_data(g.make_scene(kind, 7), 7)
    assert g.problem_text(g.make_scene("pick_two_obj_and_place", 1)) != g.problem_text(
        g.make_scene("pick_two_obj_and_place", 2)
    )

    def signature(scene):  # the game without its coordinates: room, receptacles, goal, where things are
        where = sorted((g._type_of(o), g._type_of(r)) for o, r in scene.objects)
        return scene.room, sorted(map(g._type_of, scene.receptacles)), scene.target, scene.recep, where

    for kind in g.TASK_TYPES:
        splits = {split: {str(signature(g.make_scene(kind, s))) for s in split_seeds(split, 20)} for split in SPLITS}
        assert all(len(games) >= 15 for games in splits.values())  # seeds give different games
        assert not splits["train"] & splits["test"] and not splits["validation"] & splits["test"], kind


def test_walkthrough_demonstrations_are_played_in_the_runs_env(rows, tmp_path):
    env = AlfWorldEnv(admissible_commands=True)
    path = resolve_demo_source("alfworld:test:2", env, "alfworld", {"admissible_commands": True}, {})
    demos = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len(demos) == len(rows) and {d["task_id"].split("/")[0] for d in demos} == set(g.TASK_TYPES)
    (chat,) = demos[0]["messages"]
    assert all("Valid commands:" in m["content"] for m in chat if m["role"] == "user")
    clash = r"data.demos.path='alfworld:test:2' draws from the games of data.val_path='alfworld:test:4'"
    with pytest.raises(ConfigError, match=clash):
        resolve_demo_source("alfworld:test:2", env, "alfworld", {}, {"data.val_path": "alfworld:test:4"})
    with pytest.raises(ConfigError, match="names alfworld walkthroughs, but data.env='textworld' does not play"):
        resolve_demo_source("alfworld:test:2", make_env("textworld"), "textworld", {}, {})


def test_a_tree_branches_alfworld_games_by_replay_only():
    from lit_marl.data import RolloutDataModule

    path = resolve_source("alfworld:test:2")
    assert RolloutDataModule(train_path=path, env="alfworld", branch="replay").env.num_agents == 1
    with pytest.raises(ConfigError, match="cannot copy its state; set data.branch=replay"):
        RolloutDataModule(train_path=path, env="alfworld", branch="clone")


# ---------------------------------------------------------------------- official data
def official_layout(rows, root: Path) -> Path:
    """The layout alfworld-download writes, from generated games: one per type in train, plus an
    unsolvable game and a movable-receptacle task that the loader must leave out."""
    split = root / "json_2.1.1" / "train"
    for row in rows[::2]:
        source = Path(row["game"]).parent
        shutil.copytree(source, split / source.parent.name / source.name)
    first = Path(rows[0]["game"]).parent
    for name, change in (("unsolvable", {"solvable": False}), ("pick_and_place_with_movable_recep-x", {})):
        target = split / f"{name}-1" / "trial_1"
        shutil.copytree(first, target)
        data = json.loads((target / "game.tw-pddl").read_text())
        (target / "game.tw-pddl").write_text(json.dumps({**data, **change}))
    return root


def test_official_games_from_alfworld_data(rows, tmp_path, monkeypatch):
    data = official_layout(rows, tmp_path / "alfworld")
    monkeypatch.setenv("ALFWORLD_DATA", str(data))
    listed = [json.loads(x) for x in Path(resolve_source("alfworld-data:train")).read_text().splitlines()]
    assert sorted(r["task_type"] for r in listed) == sorted(g.TASK_TYPES)  # the two odd ones left out
    assert not any("unsolvable" in r["game"] or "movable" in r["game"] for r in listed)
    assert len([json.loads(x) for x in Path(resolve_source("alfworld-data:train:1")).read_text().splitlines()]) == 6
    with pytest.raises(ConfigError, match=r"no ALFWorld games at .*valid_seen .*the layout is"):
        resolve_source("alfworld-data:valid_seen", "data.val_path")
    with pytest.raises(ConfigError, match=r"ALFWorld split 'dev'; choose one of"):
        resolve_source("alfworld-data:dev")
    monkeypatch.delenv("ALFWORLD_DATA")
    with pytest.raises(ConfigError, match="set ALFWORLD_DATA to the folder alfworld-download wrote"):
        resolve_source("alfworld-data:train")


@pytest.mark.skipif(not os.environ.get("ALFWORLD_DATA"), reason="ALFWORLD_DATA is not set: no official games here")
@pytest.mark.parametrize("split", g.OFFICIAL_SPLITS)
def test_the_expert_plans_of_the_first_official_games_win(split):
    env = AlfWorldEnv()
    for row in [json.loads(x) for x in Path(resolve_source(f"alfworld-data:{split}:2")).read_text().splitlines()]:
        env.demonstration(row)  # raises unless the expert's play wins


# ---------------------------------------------------------------------- mixtures and bad input
def test_a_task_type_mixture_gives_equal_shares():
    rows = [{"task_type": "a", "i": i} for i in range(3)] + [{"task_type": "b", "i": 9}, {"task_type": "c", "i": 8}]
    mixed = mixture(rows, ["a", "b"], "data.task_types")
    assert [r["task_type"] for r in mixed] == ["a"] * 3 + ["b"] * 3 and [r["i"] for r in mixed[3:]] == [9, 9, 9]
    with pytest.raises(ConfigError, match=r"data.task_types: no task rows of \['z'\]; the rows hold \['a', 'b', 'c'\]"):
        mixture(rows, ["a", "z"], "data.task_types")
    with pytest.raises(ConfigError, match="need a 'task_type' field"):
        mixture([{"x": 1}], ["a"], "data.task_types")


def test_bad_alfworld_input_is_named(tmp_path, rows):
    env = AlfWorldEnv()
    with pytest.raises(FileNotFoundError, match=r"task\['game'\]='/nope/game.tw-pddl': no such ALFWorld game"):
        env.start({"game": "/nope/game.tw-pddl"})
    with pytest.raises(KeyError, match="needs the field 'game'"):
        env.start({"task_type": "pick_and_place_simple"})
    broken = tmp_path / "broken.tw-pddl"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not a tw-pddl game .not JSON"):
        env.start({"game": str(broken)})
    broken.write_text(json.dumps({"pddl_domain": "x"}))
    with pytest.raises(ValueError, match="not a tw-pddl game .no grammar, pddl_problem"):
        env.start({"game": str(broken)})
    data = json.loads(Path(rows[0]["game"]).read_text())
    broken.write_text(json.dumps({**data, "pddl_problem": data["pddl_problem"].replace("(:init", "(:init (", 1)}))
    with pytest.raises(ValueError, match="not a playable ALFWorld game"):
        env.start({"game": str(broken)})
    assert g.task_type("pick_clean_then_place", "data.task_types") == "pick_clean_then_place_in_recep"
    with pytest.raises(ConfigError, match="data.task_types: unknown ALFWorld task type 'pick_and_eat'"):
        g.task_type("pick_and_eat", "data.task_types")
    with pytest.raises(ConfigError, match=r"alfworld:<split>:<count per task type>"):
        resolve_source("alfworld:train")
    with pytest.raises(ConfigError, match=r"split='dev': choose one of"):
        resolve_source("alfworld:dev:1")


def test_the_state_key_is_the_world_not_the_path(rows):
    row = next(r for r in rows if r["task_type"] == "pick_and_place_simple")
    env = AlfWorldEnv()
    plan = [turn[0] for turn in env.expert_turns(row)]
    env.start(row)
    start = env.state_key()
    env.act(["inventory"])
    env.act(["look"])
    assert env.state_key() == start  # the domain's "checked" memory is not the state
    env.act([plan[0]])
    there = env.state_key()
    assert there != start
    env.act(["go to " + next(p for p in plan[1:] if p.startswith("go to ")).removeprefix("go to ")])
    env.act([plan[0]])
    assert env.state_key() == there  # back again: the same state, whatever the detour
    env.act([plan[1]])
    assert env.state_key() != there
