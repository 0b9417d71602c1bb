"""TextWorld games generated offline and played as an ``Env``: walkthroughs win with the full
score, wrong play does not, eating tw-simple's food loses, clones are independent, commands are
sanitized, and bad input fails clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_marl import ConfigError
from lit_marl.envs import make_env
from lit_marl.envs.textworld import TextWorldEnv
from lit_marl.envs.textworld.env import clean, sanitize
from lit_marl.envs.textworld.games import (
    GUIDE_COMPLEXITIES,
    SPLITS,
    Complexity,
    check_seed_ranges,
    make_games,
    split_seeds,
    write_tasks,
)

COMPLEXITIES = ["w2-o3-q4", "w8-o3-q4", "w4-o6-q8", "tw-simple-sparse", "tw-simple-balanced", "tw-simple-dense"]


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """One test-split game of each complexity (generated once for the module, two processes)."""
    root = tmp_path_factory.mktemp("textworld")
    paths = {}
    for complexity in COMPLEXITIES:
        (paths[complexity],), _ = make_games(complexity, [1], root)
    return root, paths


def play(env: TextWorldEnv, commands: list[str]):
    result = None
    for command in commands:
        result = env.act([command])
        if result.terminated:
            break
    return result


@pytest.mark.parametrize("complexity", COMPLEXITIES)
def test_the_walkthrough_wins_with_the_full_score(games, complexity):
    _, paths = games
    env = make_env("textworld")
    task = {"game": str(paths[complexity])}
    first = env.start(task)[0]
    assert "TextWorld" not in first.splitlines()[0] or "$$" not in first  # the banner is gone
    assert "You are in the" in first and ">" not in first.splitlines()[-1]
    walkthrough = [turn[0] for turn in env.expert_turns(task)]
    result = play(env, walkthrough)
    assert result.terminated and result.info["won"] and not result.info["lost"]
    assert result.info["score"] == result.info["max_score"] > 0  # normalized return 1.0


def test_wrong_play_does_not_win(games):
    _, paths = games
    env = TextWorldEnv()
    env.start({"game": str(paths["w2-o3-q4"])})
    walkthrough = [turn[0] for turn in env.expert_turns({"game": str(paths["w2-o3-q4"])})]
    result = play(env, ["dance", "go nowhere", *reversed(walkthrough[1:])])
    assert not result.info["won"] and result.info["score"] < result.info["max_score"]


@pytest.mark.parametrize("rewards", ["sparse", "balanced", "dense"])
def test_eating_the_food_in_tw_simple_is_lost(games, rewards):
    _, paths = games
    task = {"game": str(paths[f"tw-simple-{rewards}"])}
    env = TextWorldEnv()
    env.start(task)
    walkthrough = [turn[0] for turn in env.expert_turns(task)]
    food = walkthrough[-1].split()[1]  # "put <food> on stove"
    result = play(env, [*walkthrough[:-1], f"eat {food}"])
    assert result.terminated and result.info["lost"] and not result.info["won"]


def test_sibling_clones_diverge_and_leave_each_other_alone(games):
    _, paths = games
    task = {"game": str(paths["w2-o3-q4"])}
    env = TextWorldEnv()
    env.start(task)
    walkthrough = [turn[0] for turn in env.expert_turns(task)]
    env.act([walkthrough[0]])
    a, b = env.clone(), env.clone()
    took = a.act([walkthrough[1]]).observations[0]
    dropped = b.act(["drop " + walkthrough[0].split(" from ")[0].removeprefix("take ")]).observations[0]
    assert took != dropped
    inventories = [e.act(["inventory"]).observations[0] for e in (a, b, env)]
    assert len(set(inventories)) >= 2
    # the parent is where it was: it still finishes the quest from its own state
    assert play(env, walkthrough[1:]).info["won"]
    # replaying the prefix gives the same state as copying it
    replayed = a.replay_clone()
    assert replayed.act(["inventory"]).observations[0] == a.act(["inventory"]).observations[0]


def test_commands_are_sanitized():
    assert sanitize("Open the chest!\nThen take the key.") == "open the chest"
    assert sanitize("  \n> take key; restart\n") == "take key restart"
    assert sanitize("") == "look" and sanitize("***") == "look"
    assert len(sanitize("go " * 100)) <= 160
    # a generated game's walkthrough command, whole (an 80-character cut lost a seed's quest)
    command = "unlock henderson's limited edition locker with henderson's limited edition latchkey"
    assert sanitize(command) == command


def test_clean_drops_the_banner_the_prompt_and_the_status_line():
    raw = "  $$$$  $$\n  \\$$ \n\n-= Studio =-\nYou are here.\n\n\n>   -= Studio =-0/4\n"
    assert clean(raw) == "-= Studio =-\nYou are here."


def test_complexities_and_splits():
    assert Complexity.parse("w2-o3-q4") == Complexity("w2-o3-q4", 2, 3, 4, 1)
    assert Complexity.parse("w4-o6-q8-b2").quest_breadth == 2
    assert Complexity.parse("tw-simple-dense").simple_rewards == "dense"
    assert all(Complexity.parse(c) for c in GUIDE_COMPLEXITIES)
    check_seed_ranges(SPLITS)  # the guide's ranges are disjoint
    assert split_seeds("test", 3) == [1, 2, 3] and split_seeds("train", 1) == [50001]


@pytest.mark.parametrize("name", ["w2-o3", "tw-simple-extreme", "w0-o3-q4", "simple"])
def test_an_unknown_complexity_is_refused(name):
    with pytest.raises(ConfigError, match=rf"complexity={name!r}"):
        Complexity.parse(name)


def test_overlapping_seed_ranges_are_refused():
    with pytest.raises(ConfigError, match=r"'test' and 'validation' overlap"):
        check_seed_ranges({"train": (500, 600), "validation": (50, 120), "test": (1, 100)})
    with pytest.raises(ConfigError, match=r"has only 100 seeds"):
        split_seeds("test", 101)


def test_a_missing_or_corrupt_game_fails_clearly(games, tmp_path):
    _, paths = games
    env = TextWorldEnv()
    with pytest.raises(FileNotFoundError, match=r"task\['game'\]=.*no such game file"):
        env.start({"game": str(tmp_path / "nope.z8")})
    corrupt = tmp_path / "corrupt.z8"
    corrupt.write_bytes(b"not a z-machine file" * 10)  # Jericho would kill the process on this
    with pytest.raises(ValueError, match=r"not a playable TextWorld game \(no Z-machine header\)"):
        env.start({"game": str(corrupt)})
    cut = tmp_path / "cut.z8"
    cut.write_bytes(paths["w2-o3-q4"].read_bytes()[:5000])  # a download or copy cut short
    with pytest.raises(ValueError, match=r"the file has 5000: cut short"):
        env.start({"game": str(cut)})
    damaged = bytearray(paths["w2-o3-q4"].read_bytes())
    damaged[len(damaged) // 2 : len(damaged) // 2 + 4000] = bytes(4000)  # a good header, a damaged body
    (tmp_path / "damaged.z8").write_bytes(damaged)
    with pytest.raises(ValueError, match=r"its checksum does not match its bytes: the file is damaged"):
        env.start({"game": str(tmp_path / "damaged.z8")})
    with pytest.raises(KeyError, match=r"needs the field 'game'"):
        env.start({"path": "x"})


def test_task_rows_are_written_per_split_and_games_are_cached(games):
    root, paths = games
    out = write_tasks("w2-o3-q4", "test", 1, root)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row == {"game": str(paths["w2-o3-q4"].resolve()), "complexity": "w2-o3-q4", "seed": 1, "split": "test"}
    before = paths["w2-o3-q4"].stat().st_mtime_ns
    _, seconds = make_games("w2-o3-q4", [1], root)
    assert paths["w2-o3-q4"].stat().st_mtime_ns == before and seconds < 0.5  # cached: not generated again
    assert not list(root.rglob(".*partial*"))  # no leftovers of the compiler


def test_a_named_game_set_and_its_walkthrough_demonstrations(monkeypatch, tmp_path):
    """``textworld:<complexity>:<split>:<count>`` generates the games once; as ``data.demos.path`` it
    gives the walkthroughs played in the data module's own environment (its observations), cached."""
    from lit_marl.data import EpisodeDataModule
    from lit_marl.envs.sources import resolve_demo_source, resolve_source
    from lit_marl.rollout.demos import load_demos

    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path))
    tasks = resolve_source("textworld:w2-o3-q4:validation:2")
    rows = [json.loads(line) for line in open(tasks)]
    assert [r["seed"] for r in rows] == [40001, 40002] and tasks.startswith(str(tmp_path))
    env = TextWorldEnv(admissible_commands=True)
    path = resolve_demo_source("textworld:w2-o3-q4:validation:2", env, "textworld", {"admissible_commands": True}, {})
    demos = load_demos(path, 1)
    assert [d["task_id"] for d in demos] == ["w2-o3-q4/40001", "w2-o3-q4/40002"]
    (chat,) = demos[0]["messages"]
    walkthrough = [turn[0] for turn in env.expert_turns(rows[0])]
    assert [m["content"] for m in chat if m["role"] == "assistant"] == walkthrough
    assert all("Valid commands:" in m["content"] for m in chat if m["role"] == "user")  # this env's observations
    mtime = Path(path).stat().st_mtime_ns
    again = resolve_demo_source("textworld:w2-o3-q4:validation:2", env, "textworld", {"admissible_commands": True}, {})
    assert again == path
    assert Path(path).stat().st_mtime_ns == mtime  # cached
    other = resolve_demo_source("textworld:w2-o3-q4:validation:2", TextWorldEnv(), "textworld", {}, {})
    assert other != path and "Valid commands:" not in Path(other).read_text()  # other settings, other observations
    assert len(load_demos(resolve_demo_source("textworld:w2-o3-q4:validation:1", env, "textworld", {}, {}), 1)) == 1
    assert len(load_demos(path, 1)) == 2  # a set of another count never overwrites this one's rows
    with pytest.raises(ConfigError, match=r"data.demos.path='textworld:w2-o3-q4:validation:2' names textworld "
                       r"walkthroughs, but data.env='corridor' does not play them"):  # fmt: skip
        resolve_demo_source("textworld:w2-o3-q4:validation:2", make_env("corridor", {}), "corridor", {}, {})
    with pytest.raises(ConfigError, match=r"a count of at least 1"):
        resolve_source("textworld:w2-o3-q4:train:0")
    clash = r"data.demos.path='textworld:w2-o3-q4:validation:2' draws from the games of data.val_path"
    with pytest.raises(ConfigError, match=clash):
        EpisodeDataModule(
            train_path="textworld:w2-o3-q4:train:1",
            val_path="textworld:w2-o3-q4:validation:2",
            env="textworld",
            demos={"path": "textworld:w2-o3-q4:validation:2"},
        )
    unnamed = r"data.train_path='textworld:w2-o3-q4:train': name a game set as textworld:<complexity>:<split>:<count>"
    with pytest.raises(ConfigError, match=unnamed):
        resolve_source("textworld:w2-o3-q4:train")
    with pytest.raises(ConfigError, match=r"data.demos.path='textworld:w2-o3-q4:validation:200': count=200: split "
                       r"'validation' has only 100 seeds"):  # fmt: skip
        resolve_source("textworld:w2-o3-q4:validation:200", "data.demos.path")
    with pytest.raises(ConfigError, match=r"data.train_path='textworld:w2-o3-q4:dev:2': split='dev': choose one of"):
        resolve_source("textworld:w2-o3-q4:dev:2")
    with pytest.raises(ConfigError, match=r"data.train_path=.w2-x3.: not a complexity"):
        resolve_source("textworld:w2-x3:train:1")


def test_the_state_key_is_the_world_not_the_path(games):
    _, paths = games
    task = {"game": str(paths["w2-o3-q4"])}
    env = TextWorldEnv()
    env.start(task)
    start = env.state_key()
    walkthrough = [turn[0] for turn in env.expert_turns(task)]
    env.act(["look"])
    env.act(["inventory"])
    assert env.state_key() == start  # looking changes nothing in the world
    env.act([walkthrough[0]])
    assert env.state_key() != start
    twin = TextWorldEnv()
    twin.start(task)
    twin.act([walkthrough[0]])
    assert twin.state_key() == env.state_key()  # another path (no looking) to the same world


def test_ranks_of_a_node_generate_a_named_set_one_at_a_time(tmp_path, monkeypatch):
    """Every rank resolves data.train_path; with the node's lock the first generates and the others
    wait, then find the games cached (here: a resolver that records how many run at once)."""
    import threading
    import time

    from lit_marl.envs import sources

    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path))
    inside, most, lock = [0], [0], threading.Lock()

    def resolver(source, field):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        with lock:
            inside[0] -= 1
        return str(tmp_path / "tasks.jsonl")

    monkeypatch.setattr(TextWorldEnv, "resolve_set", staticmethod(resolver))
    ranks = [threading.Thread(target=sources.resolve_source, args=("textworld:w2-o3-q4:train:2",)) for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert most[0] == 1
    assert (tmp_path / ".textworld.lock").exists()
