"""MAGRPO trees over a stateful game (``envs.game.Game``): each joint action steps its own copy
of its node's game, siblings never see each other's moves, tree sizes and generate calls are a
stateless tree's, and the rewards follow the episodes' density rule."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import AdmissibleEngine, RecordingEngine, make_trainer, snapshot, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.data import RolloutDataModule
from lit_marl.envs import make_env
from lit_marl.envs.game import Game, RewardRule, StepResult
from lit_marl.envs.textworld.games import write_tasks
from lit_marl.generation import Sampling
from lit_marl.rollout.tree import TreeSettings, build_tree
from lit_marl.tasks import load_tasks


@pytest.fixture(scope="module")
def team_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("textworld")
    return {c: write_tasks(c, "train", 2, root) for c in ("w2-o3-q4", "tw-simple-dense")}


def rows(path):
    return load_tasks(str(path), "data.train_path", set())


class Result:
    """One branch's step as the assertions read it."""

    def __init__(self, state):
        self.observations = state.observations


def step(env, state, actions):
    """A joint action on its own branch of ``state``: the child state and the step's result."""
    child = env.branch(state)
    env.step([child], [actions], turn=0)
    return child, Result(child)


@pytest.mark.parametrize("joint_mode, per_node, turns", [("aligned", 2, 3), ("cross", 4, 2)])
def test_a_tree_over_textworld_has_a_stateless_trees_sizes_and_calls(
    tiny_agents, team_tasks, joint_mode, per_node, turns
):
    """G=2, two agents, two tasks: G (aligned) or G^N (cross) children per node, none ending early
    (random play does not finish a quest)."""
    env = make_env("textworld-team")
    engine = RecordingEngine()
    settings = TreeSettings(
        num_generations=2, joint_mode=joint_mode, num_turns=turns, sampling=Sampling(max_new_tokens=4)
    )
    batch = build_tree(tiny_agents, rows(team_tasks["w2-o3-q4"]), env, settings, engine=engine)
    assert [batch.stats[f"turn_{t}/nodes"] for t in range(turns)] == [2 * per_node**t for t in range(turns)]
    assert len(engine.calls) == 2 * turns  # one batched generate per agent per turn
    assert batch.metrics["won"] == 0.0 and torch.isfinite(batch.rewards).all()


def test_sibling_branches_step_their_own_copies(team_tasks):
    env = make_env("textworld-team")
    (task, _) = rows(team_tasks["w2-o3-q4"])
    (root,) = env.reset([task])
    plan, command = env.spawn().expert_turns(task)[0]
    took, result_a = step(env, root, [plan, command])
    stayed, result_b = step(env, root, ["look around", "inventory"])
    assert result_a.observations[0] != result_b.observations[0]
    assert took.played == [[plan, command]] and stayed.played == [["look around", "inventory"]]
    # the root is untouched: stepping it again gives the first branch's result once more
    _, again = step(env, root, [plan, command])
    assert again.observations == result_a.observations
    assert "The planner's plan: look around" in result_b.observations[1]


def test_replay_branching_gives_the_clones_games(team_tasks):
    (task, _) = rows(team_tasks["tw-simple-dense"])
    games = [make_env("textworld-team") for _ in range(2)]
    games[0].branching, games[1].branching = "clone", "replay"
    expert = games[0].spawn().expert_turns(task)
    seen = []
    for env in games:
        (state,) = env.reset([task])
        observations = []
        for actions in expert[:3]:
            state, result = step(env, state, actions)
            observations.append(result.observations)
        seen.append((observations, state.score))
    assert seen[0] == seen[1]


class Counter(Game):
    """Two agents; every turn scores 1 of 4; ``finish`` (the rollout ended it) wins a game with 2 or more,
    as a game that scores on ``submit``."""

    num_agents = 2

    def start(self, task):
        self.score = 0
        return ["go", "go"]

    def act(self, actions):
        self.score += 1
        return StepResult(["go", "go"], terminated=self.score == 4, info=self.info(self.score == 4))

    def info(self, won):
        return {"won": won, "lost": False, "score": float(self.score), "max_score": 4.0}

    def finish(self):
        return self.info(self.score >= 2)


@pytest.mark.parametrize("density", ["sparse", "dense"])
def test_a_game_step_returns_its_rewards_and_end_pays_the_cut_turn(density):
    """The density rule lives in the game: ``step`` pays each turn (sparse: only the turn that ends
    the episode; ``last``: the rollout's final turn ends it), ``end`` pays a turn the rollout cut."""
    game = Counter()
    game.reward_rule = RewardRule(density)
    states = game.reset([{}, {}])
    first = game.step(states, [["a", "b"]] * 2, 0)
    assert first.rewards.shape == (2, 2)
    assert first.rewards.tolist() == [[0.0, 0.0]] * 2 if density == "sparse" else [[0.125, 0.125]] * 2
    second = game.step(states[:1], [["a", "b"]], 1, last=True)  # the rollout's last turn: it ends here
    assert second.rewards.tolist() == ([[0.0, 0.0]] if density == "sparse" else [[0.125, 0.125]])
    (ended,) = game.end(states[:1])  # finish() wins it now: the cut turn pays the outcome
    assert ended.info["won"] and ended.rewards == ([1.0, 1.0] if density == "sparse" else [1.125, 1.125])
    for _ in range(3):
        played = game.step(states[1:], [["a", "b"]], 2)
    assert played.done == [True] and played.metrics == {"won": 1.0, "lost": 0.0}
    assert played.rewards.tolist() == ([[1.0, 1.0]] if density == "sparse" else [[1.125, 1.125]])


class CountedGames(Counter):
    """``Counter`` that counts the games started and closed (each branch replays into a fresh one)."""

    opened = closed = 0

    def start(self, task):
        CountedGames.opened += 1
        return super().start(task)

    def close(self):
        CountedGames.closed += 1


def test_a_tree_over_a_game_scores_the_branches_it_cuts_and_releases_every_state(tiny_agents):
    """Two turns of a game that scores on ``finish`` (as SWE scores on submit): the last turn's
    branches are ended by the rollout, so ``end`` scores them (sparse: the outcome, won); every game
    the tree started (roots, branches) is closed by the time it returns."""
    CountedGames.opened = CountedGames.closed = 0
    settings = TreeSettings(num_generations=2, num_turns=2, sampling=Sampling(max_new_tokens=2))
    batch = build_tree(tiny_agents, [{}, {}], CountedGames(), settings, engine=RecordingEngine())
    first, second = batch.turn_rewards
    assert first.tolist() == [0.0] * 4 and second.tolist() == [1.0] * 8  # 2 tasks x 2, then x 2 again
    assert CountedGames.opened > 0 and CountedGames.closed == CountedGames.opened
    assert batch.leaf_success.tolist() == [1.0] * 8


def test_the_data_module_hands_its_reward_rule_to_the_game(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"length": 3, "key_room": 1}\n')
    data = RolloutDataModule(
        train_path=str(tmp_path / "tasks.jsonl"), env="corridor", reward_density="dense", score_weight=0.25
    )
    assert data.env.reward_rule == RewardRule("dense", 0.25)


def test_bad_game_settings_fail_clearly():
    with pytest.raises(ConfigError, match=r"data\.env='maze'"):
        RolloutDataModule(train_path="unused.jsonl", env="maze")
    with pytest.raises(ValueError, match=r"score_weight=1.0"):
        RolloutDataModule(train_path="unused.jsonl", env="corridor", reward_density="dense", score_weight=1.0)


def test_magrpo_learns_from_a_tree_over_a_game(tmp_path, team_tasks):
    """tw-simple's dense score: the listed commands the two agents pick earn different rewards,
    so advantages are not all 0 and MAGRPO moves both agents."""
    L.seed_everything(0)
    data = RolloutDataModule(
        train_path=str(team_tasks["tw-simple-dense"]),
        env="textworld-team",
        env_kwargs={"admissible_commands": True},
        reward_density="dense",
        tasks_per_step=2,
        num_generations=4,
        num_turns=2,
    )
    data.engine = AdmissibleEngine()
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    module.configure_model()
    before = [snapshot(a.model) for a in module.agents]
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert float(metrics["agent1/advantage_abs"]) > 0 and torch.isfinite(metrics["agent1/loss"])
    assert float(metrics["train/reward_std"]) > 0
    for agent, weights in zip(module.agents, before):
        assert len(unchanged(agent.model, weights)) < len(weights)
