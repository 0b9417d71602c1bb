"""Iterative MADPO on the tiny random model: every comparator fits (parameters move, losses
finite, the run ends after its iterations), ``history`` before its first snapshot is the initial
policy, the comparator samples with its own random stream, the HTTP comparator's timeouts are
counted skips. (Resume: tests/fit/test_resume.py; the pure parts: tests/unit/test_iterative_preference.py.)"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from helpers import LENGTH_REWARD, comparator_server, make_trainer, slogan_data, snapshot, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import IterativeMADPO


def _fit(tmp_path, steps=10, **kwargs):
    L.seed_everything(0)
    settings = dict(model="tiny-random", num_agents=2, learning_rate=1e-2, num_iterations=2, steps_per_iteration=2)
    module = IterativeMADPO(**{**settings, **kwargs})
    module.configure_model()
    before = [snapshot(agent.model) for agent in module.agents]
    trainer = make_trainer(tmp_path, limit_train_batches=steps, limit_val_batches=0)
    trainer.fit(
        module, datamodule=slogan_data(reward_fn=LENGTH_REWARD, num_generations=4, sampling={"max_new_tokens": 12})
    )
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return module, trainer, metrics, before


@pytest.mark.parametrize(
    "comparator",
    [
        {"comparator_policy": "current"},
        {"comparator_policy": "current_copy", "preference_replay_mode": "nearest_k", "preference_replay_k": 2},
        {"comparator_policy": "model", "comparator_model": "tiny-random", "preference_replay_mode": "all_history"},
    ],
)
def test_fit_moves_every_agent_and_stops_after_its_iterations(tmp_path, comparator):
    module, trainer, metrics, before = _fit(tmp_path, **comparator)
    assert module.steps_done == 4 and trainer.global_step == 4 * 2  # 2 iterations x 2 steps, 2 learners
    assert metrics["iter/iteration"] == 1.0 and metrics["iter/new_pairs"] > 0
    assert math.isfinite(metrics["train/loss"]) and 0 <= metrics["iter/target_win_rate"] <= 1
    assert [s.iteration for s in module.replay.shards] == [0, 0, 1, 1]
    for agent, old in zip(module.agents, before):
        assert not unchanged(agent.model, old)
        assert all(torch.isfinite(p).all() for p in agent.model.parameters())
    if comparator["comparator_policy"] == "current_copy":  # a snapshot as each iteration began
        assert len(module.snapshots) == 2


def test_history_before_its_first_snapshot_is_the_initial_policy(tmp_path):
    """k = 2 over 2 iterations always compares with snapshot 0, the initial weights: the run equals
    one whose comparator is a freshly loaded copy of the initial model."""
    history, _, seen, _ = _fit(tmp_path / "h", comparator_policy="history", comparator_history_k=2)
    model, _, expected, _ = _fit(tmp_path / "m", comparator_policy="model", comparator_model="tiny-random")
    for key in ("iter/comparator_reward", "iter/new_pairs", "iter/target_win_rate", "train/reward_gap"):
        assert seen[key] == expected[key], key  # the same comparator samples, the same pairs
    for a, b in zip(history.agents, model.agents):  # float noise of the second run in one process: ~1e-5
        for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-4, msg=name)
    current_copy, *_ = _fit(tmp_path / "c", comparator_policy="history", comparator_history_k=1)
    assert unchanged(current_copy.agents[0].model, snapshot(history.agents[0].model)) == []  # k matters


def test_the_comparator_samples_with_its_own_stream():
    """Sampling inside ``comparator_team`` draws from the comparator's stream and leaves the
    policy's (the global one) where it was."""
    L.seed_everything(0)
    module = IterativeMADPO(model="tiny-random", num_agents=2)
    module.configure_model()
    before = torch.get_rng_state()
    expected = torch.rand(3, generator=torch.Generator().manual_seed(torch.initial_seed() + 1))
    with module.comparator_team([{}]) as comparator:
        drawn = torch.rand(3)
        assert comparator.agents == list(module.agents) and comparator.engine is None
    assert torch.equal(drawn, expected) and torch.equal(torch.get_rng_state(), before)
    with module.comparator_team([{}]):
        assert not torch.equal(torch.rand(3), expected)  # the stream continues, not restarts


def test_api_comparator_fits_and_counts_timeouts(tmp_path):
    with comparator_server() as server:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        api = {"url": f"{base}/every_other_slow", "timeout_s": 0.3, "response_field": "out.texts"}
        module, _, metrics, before = _fit(tmp_path, steps=1, comparator_policy="api", comparator_api=api)
        assert len(server.seen) == 4  # 2 tasks x 2 roles
        # half the requests timed out: each one's 4 candidates (of one task) leave their joint candidates unpaired
        assert metrics["iter/comparator_skipped"] == 4 and metrics["iter/new_pairs"] <= 4
        assert math.isfinite(metrics["train/loss"]) and not unchanged(module.agents[0].model, before[0])
        slow = {**api, "url": f"{base}/slow"}  # every request times out: the run stops at the second such step
        with pytest.raises(RuntimeError, match="no usable candidate in the last 2 steps"):
            _fit(
                tmp_path / "slow", steps=3, comparator_policy="api", comparator_api=slow, max_skipped_comparator_steps=2
            )


def test_centralized_comparators_fit(tmp_path):
    """``centralized``: one comparator model writes both roles (split by an adapter); texts become
    rows of the policy. ``centralized_sequential`` over an endpoint: one request per role and candidate."""
    module, _, metrics, before = _fit(
        tmp_path / "c",
        steps=1,
        comparator_policy="model",
        comparator_model="tiny-random",
        comparator_generation_mode="centralized",
        comparator_adapter="helpers:HalvesAdapter",
    )
    assert metrics["iter/new_pairs"] > 0 and metrics["iter/comparator_skipped"] == 0
    assert math.isfinite(metrics["train/loss"]) and not unchanged(module.agents[1].model, before[1])
    with comparator_server() as server:
        api = {"url": f"http://127.0.0.1:{server.server_address[1]}/tagged"}
        mode = "centralized_sequential"
        _, _, metrics, _ = _fit(
            tmp_path / "s", steps=1, comparator_policy="api", comparator_api=api, comparator_generation_mode=mode
        )
        assert len(server.seen) == 2 * 2 * 4  # roles x tasks x candidates, one text each
        assert [body["agent_idx"] for _, _, body in server.seen] == [0] * 8 + [1] * 8
        assert "<agent_0>\nline" in server.seen[8][2]["prompt"]  # role 1 sees role 0's output
        assert metrics["iter/comparator_skipped"] == 0 and math.isfinite(metrics["train/loss"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"comparator_history_k": 2}, r"comparator_history_k=2 belongs to comparator_policy: history"),
        ({"comparator_policy": "model"}, r"comparator_model is needed by, and only by"),
        ({"comparator_api": {"url": "http://127.0.0.1:1"}}, r"comparator_api is needed by, and only by"),
        ({"preference_replay_mode": "nearest_k"}, r"needs model.preference_replay_k"),
        ({"pairs": {"selection": "all"}}, r"pairs.selection=all keeps every pair"),
        ({"preference_replay_lambda": 1.5}, r"preference_replay_lambda=1.5: must be >= 0 and <= 1"),
        ({"comparator_centralized_agent_index": 2}, r"comparator_centralized_agent_index=2: there are 2 agents"),
        ({"comparator_adapter": "nowhere:Adapter"}, r"model.comparator_adapter"),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        IterativeMADPO(model="tiny-random", num_agents=2, **kwargs)
