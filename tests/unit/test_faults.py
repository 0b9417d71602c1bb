"""Faults in what the user plugs in: rewards and transitions that hang, fail for some batches,
return absurd values or fail every time; each ends in a stated policy, never a silent stall or a
run that trains nothing and exits 0."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import make_trainer, slogan_data, tree_from_functions
from lit_marl.algorithms import MAGRPO
from lit_marl.envs.calls import CallTimeout, RewardError, call_reward, call_with_timeout
from lit_marl.generation import Sampling
from lit_marl.rollout.transitions import plain

TASKS = [{"topic": "tea"}, {"topic": "winter"}]
COMPLETIONS = [["a", "b"], ["c", "d"]]


def _prompts(num_agents: int) -> list[list[str]]:
    return [[f"agent {i}: write about {t['topic']}" for i in range(num_agents)] for t in TASKS]


def sleepy(agent_completions, tasks):
    time.sleep(30)
    return [1.0] * len(tasks)


def test_a_hanging_reward_stops_the_run_at_its_time_limit_naming_it():
    start = time.perf_counter()
    with pytest.raises(CallTimeout, match=r"reward function sleepy .* did not return within 0.3 s.*reward_timeout_s"):
        call_reward(sleepy, COMPLETIONS, TASKS, turn=0, timeout_s=0.3)
    assert time.perf_counter() - start < 2


def test_a_hanging_reward_under_skip_skips_its_batch_once_and_counts_it():
    start = time.perf_counter()
    rewards, metrics = call_reward(sleepy, COMPLETIONS, TASKS, turn=0, on_error="skip", timeout_s=0.3)
    assert time.perf_counter() - start < 2  # not one more wait per joint action
    assert torch.isnan(rewards).all()
    assert metrics["skipped_reward_frac"] == 1.0 and metrics["reward_timeouts"] == 1.0


def test_a_batch_call_that_fails_and_then_succeeds_per_sample_is_counted():
    def batch_only_fails(agent_completions, tasks):
        if len(tasks) > 1:
            raise RuntimeError("batch too large")
        return [2.0]

    rewards, metrics = call_reward(batch_only_fails, COMPLETIONS, TASKS, on_error="skip")
    assert rewards.tolist() == [2.0, 2.0]
    assert metrics["reward_batch_failures"] == 1.0 and metrics["skipped_reward_frac"] == 0.0


@pytest.mark.parametrize("value", [3e38, -3e38, 1e16])
def test_finite_but_absurd_rewards_are_refused_or_skipped(value):
    def huge(agent_completions, tasks):
        return [value, 1.0]

    with pytest.raises(RewardError, match=r"beyond \+-1e\+15"):
        call_reward(huge, COMPLETIONS, TASKS)
    rewards, metrics = call_reward(huge, COMPLETIONS, TASKS, on_error="skip")
    assert torch.isnan(rewards[0]) and rewards[1] == 1.0 and metrics["skipped_reward_frac"] == 0.5


def test_a_nan_extra_metric_warns_and_is_averaged_over_finite_values():
    def nan_metric(agent_completions, tasks):
        return {"reward": [1.0, 0.0], "quality": [float("nan"), 0.5]}

    with pytest.warns(RuntimeWarning, match="non-finite 'quality'"):
        _, metrics = call_reward(nan_metric, COMPLETIONS, TASKS)
    assert metrics["quality"] == 0.5


def test_a_hanging_transition_stops_the_tree_naming_it(tiny_agents):
    def slow_transition(*args, **kwargs):
        time.sleep(30)
        return plain(*args, **kwargs)

    start = time.perf_counter()
    with pytest.raises(CallTimeout, match=r"transition .* after turn 0 did not return within 0.3 s"):
        tree_from_functions(
            tiny_agents,
            TASKS,
            _prompts(2),
            lambda agent_completions, tasks: [1.0] * len(tasks),
            2,
            sampling=Sampling(max_new_tokens=2),
            num_turns=2,
            transition=slow_transition,
            transition_timeout_s=0.3,
        )
    assert time.perf_counter() - start < 10


def test_call_with_timeout_passes_values_and_errors_through():
    assert call_with_timeout(lambda x: x + 1, 5.0, "f", "", x=1) == 2
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["k"], 5.0, "f", "")


def test_a_reward_that_always_fails_under_skip_stops_the_run(tmp_path):
    """It trained nothing and exited 0 before."""
    data = slogan_data(
        reward_fn="helpers:raising_reward", reward_calls={"on_reward_error": "skip", "max_skipped_steps": 2}
    )
    trainer = make_trainer(tmp_path, limit_train_batches=5, limit_val_batches=0, logger=False)
    with pytest.raises(RewardError, match=r"every reward of the last 2 training steps was skipped"):
        trainer.fit(MAGRPO(model="tiny-random", learning_rate=1e-3), datamodule=data)
    assert trainer.fit_loop.total_batch_idx <= 2


@pytest.mark.parametrize("setting", ["limit_train_batches", "max_epochs", "max_steps"])
def test_zero_training_steps_is_refused(setting, tmp_path):
    """Each exited 0 having trained nothing."""
    trainer = make_trainer(tmp_path, limit_val_batches=0, logger=False, **{setting: 0})
    with pytest.raises(ValueError, match=rf"trainer\.{setting}=0: no training step would run"):
        trainer.fit(MAGRPO(model="tiny-random"), datamodule=slogan_data())


def test_the_cli_reports_a_failing_reward_in_one_line_with_the_users_line(in_repo_root, tmp_path, monkeypatch):
    from lit_marl.cli import main

    monkeypatch.delenv("LIT_MARL_TRACEBACK", raising=False)
    monkeypatch.setattr(
        "sys.argv",
        ["lit-marl", "fit", "--config", "configs/magrpo/slogan_tiny.yaml", "--data.init_args.reward_fn",
         "helpers:raising_reward", "--trainer.logger.init_args.save_dir", str(tmp_path)],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main()
    message = str(exit_.value.code)
    assert message.startswith("lit-marl: reward function helpers:raising_reward raised RuntimeError: the scorer")
    assert 'in raising_reward: raise RuntimeError("the scorer is down")' in message
    assert "Traceback" not in message
