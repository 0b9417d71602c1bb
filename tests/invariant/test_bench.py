"""The benchmark's fixed workload (scripts/bench_workload.py) and the call counts of one lit_marl
benchmark step: the batching invariants it reports (never timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

SCRIPTS = REPO_ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_workload as workload  # noqa: E402


def test_joint_reward_is_character_jaccard_plus_length_ratio():
    assert workload.joint_reward(["Abc", "cba"]) == pytest.approx(1.0)  # same characters, same length
    assert workload.joint_reward(["ab", "cd"]) == pytest.approx(0.5 * 0 + 0.5 * 1)
    assert workload.joint_reward(["aaaa", "a"]) == pytest.approx(0.5 * 1 + 0.5 * 0.25)
    assert workload.joint_reward(["", ""]) == pytest.approx(1.0)
    # three agents: the mean over the three pairs
    three = workload.joint_reward(["ab", "ab", "cd"])
    assert three == pytest.approx((1.0 + 0.5 + 0.5) / 3)


def test_both_frameworks_build_the_same_next_prompt():
    """lit_marl's transition gets the task's prompt as one string, as CoMLRL's does: both workers must
    give the whole task to the next turn (indexing it gave one character, a shorter prompt for lit_marl)."""
    import bench_magrpo

    task = workload.task_prompt(3)
    histories = {"prompt_history_per_agent": [[task], [task]], "response_history_per_agent": [[], []]}
    ours = bench_magrpo._transition(prompt=task, agent_completions=["a b", "c d"], num_agents=2, **histories)
    assert ours == [workload.next_prompt(task, "a b", ["c d"]), workload.next_prompt(task, "c d", ["a b"])]


def test_tasks_and_transition_are_fixed():
    assert workload.tasks(3) == workload.tasks(3)
    prompt = workload.task_prompt(7)
    assert prompt.startswith("Task 7: together write about ") and len(prompt.split(". ")[1].split()) == 8
    text = workload.next_prompt("P", "mine", ["yours", "theirs"])
    assert text == "P\nYour previous reply: mine\nPartner replies: yours | theirs\nRevise and combine both:"


def worker_step(tmp_path, *args: str) -> dict:
    """One measured step of ``bench_magrpo.py --worker`` (T=2 aligned, 6 new tokens), as it prints it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPTS)}
    args = ["--worker", *args, "--num-turns", "2", "--joint-mode", "aligned", "--max-new-tokens", "6"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_magrpo.py"), *args, "--steps", "1", "--warmup", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_benchmark_step_makes_one_generate_per_agent_per_turn(tmp_path):
    """MAGRPO, 2 agents, G=2, T=2 aligned: per step 2 turns x 2 agents generate calls (one batched
    call over all open nodes), 2 reward calls (one per turn), 2 x 2 x (1 + 2) sequences, and one
    optimizer step per agent."""
    result = worker_step(tmp_path, "--num-generations", "2")
    assert result["generate_calls_per_step"] == 4
    assert result["reward_calls_per_step"] == 2
    assert result["sequences_per_step"] == 2 * 2 * (1 + 2)
    assert result["optimizer_steps_per_step"] == 2
    assert 0 < result["generated_tokens_per_step"] <= 12 * 6


def test_the_benchmark_runs_maac_whose_critic_cannot_generate(tmp_path):
    """MAAC's critic is the decoder without its head (no ``generate``): the probe wraps its forward
    only. 2 agents, T=2: 4 generate calls, 2 reward calls, one optimizer step per agent and the
    critic's."""
    result = worker_step(tmp_path, "--algorithm", "maac", "--num-generations", "1")
    assert result["algorithm"] == "maac" and "error" not in result
    assert result["generate_calls_per_step"] == 4 and result["reward_calls_per_step"] == 2
    assert result["optimizer_steps_per_step"] == 3
