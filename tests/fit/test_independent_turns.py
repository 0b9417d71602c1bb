"""Episodes that play their own turns (``data.turns: independent``) on the vllm_server engine, against the
stand-in server of ``tests/stand_in.py``: no episode waits for another's turn, the rollout is the one
lockstep turns play (greedy) and the same whatever order replies arrive in (sampled: each request seeded by
episode, agent and turn), an episode's error reaches the caller, and colocated engines are refused."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from stand_in import StandIn

from helpers import REPO_ROOT, corridor_data
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.envs.corridor import Corridor
from lit_marl.generation import Sampling
from lit_marl.generation.server import VLLMServerEngine
from lit_marl.rollout.episode import EpisodeSettings, run_episodes

TASKS = [json.loads(line) for line in (REPO_ROOT / "data/corridor/train.jsonl").read_text().splitlines()[:4]]
SAMPLED = EpisodeSettings(group_size=2, max_turns=3, sampling=Sampling(max_new_tokens=6, temperature=1.0))
FIELDS = ("input_ids", "attention_mask", "loss_mask", "end_positions", "scores", "rewards", "rollout_logprobs")


class Shuffled(StandIn):
    """A stand-in whose replies take a random 0-60 ms each: they arrive in another order every run."""

    def generate(self, body):
        time.sleep(random.uniform(0.0, 0.06))
        return super().generate(body)


class Known(Corridor):
    """Corridor whose games know their task's index in ``TASKS``."""

    def start(self, task):
        self.index = TASKS.index(task)
        return super().start(task)


class SlowFirst(Known):
    """The first task's game takes ``slow_s`` a step; every step's (task index, time) recorded."""

    slow_s = 0.0
    log: list = []

    def play(self, actions):
        if self.index == 0:
            time.sleep(self.slow_s)
        result = super().play(actions)
        SlowFirst.log.append((self.index, time.perf_counter()))
        return result


@pytest.fixture
def served():
    """A tiny agent, a stand-in server with random reply delays, its engine (the agent's weights sent)."""
    server = Shuffled()
    agent = Agent("tiny-random")
    engine = VLLMServerEngine(servers=[server.url])
    yield agent, engine, server
    server.shutdown()


def play(agent, engine, settings, env=None, seed=0):
    torch.manual_seed(seed)
    with engine.rollout([agent]):
        return run_episodes([agent], TASKS, env or Corridor(), settings, engine)[0]


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS) and a.replies == b.replies


def test_independent_turns_play_what_lockstep_plays_and_whatever_order_replies_arrive_in(served):
    agent, engine, server = served
    greedy = EpisodeSettings(group_size=1, max_turns=3, sampling=Sampling(max_new_tokens=6, greedy=True))
    lockstep = play(agent, engine, greedy)
    independent = play(agent, engine, replace(greedy, turns="independent"))
    assert same(lockstep, independent)  # greedy: the same episodes, turn by turn
    assert int(independent.num_turns.sum()) >= len(TASKS) * 2  # several turns were played

    settings = replace(SAMPLED, turns="independent")
    sent = len(server.bodies)
    first = play(agent, engine, settings)
    seeds = [body["sampling_params"]["seed"] for body in server.bodies[sent:]]
    assert len(set(seeds)) == len(seeds) == int(first.num_turns.sum())  # every request its own stream
    again = play(agent, engine, settings)
    assert same(first, again)  # the replies came in another order: each request's seed is its episode's, turn's
    other = play(agent, engine, settings, seed=1)
    assert not torch.equal(other.input_ids, first.input_ids)  # another run seed, other samples
    assert first.rollout_logprobs is not None and torch.isfinite(first.rollout_logprobs).all()
    assert first.stats["perf/tokens_per_s"] > 0 and first.stats["train/env_steps"] == float(first.num_turns.sum())


def test_no_episode_waits_for_a_slow_episodes_turn(served):
    """The first task's game takes 0.8 s a step: with independent turns the other episodes have played all
    their turns before its second step; in lockstep each of their turns waits for it."""
    agent, engine, server = served
    greedy = EpisodeSettings(group_size=1, max_turns=3, sampling=Sampling(max_new_tokens=6, greedy=True))
    env, SlowFirst.slow_s = SlowFirst(), 0.8
    for turns in ("independent", "lockstep"):
        SlowFirst.log = []
        batch = play(agent, engine, replace(greedy, turns=turns), env=env)
        assert int(batch.num_turns[0]) >= 2  # the slow episode played at least two turns
        slow = [t for task, t in SlowFirst.log if task == 0]
        others_done = max(t for task, t in SlowFirst.log if task != 0)
        if turns == "independent":
            assert others_done < slow[1]
        else:
            assert others_done > slow[1]  # the others' later turns waited for the slow one's
    assert server.most_in_flight >= 2


def test_the_environments_work_runs_in_its_pool(served):
    """With independent turns every episode steps on its own, but no more games at once than the env's pool
    has threads (``data.env_workers``)."""
    agent, engine, _ = served

    class Counted(Known):
        now, most, lock = 0, 0, threading.Lock()

        def play(self, actions):
            with Counted.lock:
                Counted.now += 1
                Counted.most = max(Counted.most, Counted.now)
            time.sleep(0.05)
            with Counted.lock:
                Counted.now -= 1
            return super().play(actions)

    env = Counted()
    env.pool = ThreadPoolExecutor(2)
    play(agent, engine, replace(SAMPLED, turns="independent"), env=env)
    assert Counted.most == 2  # 8 episodes, 2 games at once


def test_an_episodes_error_reaches_the_caller_and_every_state_is_released(served):
    agent, engine, _ = served

    class Broken(Known):
        released: list = []

        def play(self, actions):
            if self.index == 2 and threading.current_thread().name.startswith("lit_marl_episode"):
                raise RuntimeError("the game broke")
            return super().play(actions)

        def release(self, states):
            Broken.released += states
            super().release(states)

    settings = replace(SAMPLED, turns="independent")
    with pytest.raises(RuntimeError, match="the game broke"):
        play(agent, engine, settings, env=Broken())
    assert len(Broken.released) == len(TASKS) * SAMPLED.group_size


def test_independent_turns_need_an_engine_that_generates_remotely():
    with pytest.raises(ConfigError, match="data.turns=independent: data.engine=auto generates one batch at a time"):
        corridor_data(turns="independent")
    data = corridor_data(turns="independent", engine="vllm_server", engine_options={"servers": ["http://x:1"]})
    assert data.episode.turns == "independent" and data.rollout_settings.episode.turns == "independent"
