"""One-step off-policy rollouts (``data.max_staleness: 1``) on the vllm_server engine, against the stand-in
server of ``tests/stand_in.py``: step k+1's rollout is in flight while step k updates, played by the
weights step k started from (staleness 1, logged), weighed by the truncated importance ratio; the run
trains the same tasks in the same order as an on-policy one; what cannot overlap is refused by name."""

from __future__ import annotations

import threading

import lightning as L
import pytest
import torch
from stand_in import StandIn

from helpers import corridor_data, make_trainer, slogan_data, snapshot, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import MADPO, MAGRPO, PPO

SETTINGS = dict(tasks_per_step=2, num_generations=1, max_turns=3, sampling={"max_new_tokens": 6})


class Watch(L.Callback):
    """Per training step: its rollout's stats and the tasks of the rollout in flight beside its update."""

    def __init__(self):
        self.stats, self.in_flight = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.stats.append(dict(batch[0].stats))
        pending = trainer.datamodule.ahead.pending if trainer.datamodule.ahead is not None else None
        self.in_flight.append(None if pending is None else pending.tasks)


def fit(tmp_path, staleness: int, steps: int = 3):
    """A PPO fit on Corridor with rollouts on a stand-in server: the module, its weights before, what each
    step saw, every training rollout's tasks and thread, and the server's request log."""
    server = StandIn()
    data = corridor_data(
        **SETTINGS, engine="vllm_server", engine_options={"servers": [server.url]}, max_staleness=staleness
    )
    rollouts = []
    rollout_batch = data.rollout_batch

    def recording(team, tasks, training):
        rollouts.append((tasks, threading.current_thread().name))
        return rollout_batch(team, tasks, training)

    data.rollout_batch = recording
    module = PPO(model="tiny-random", update={"rollout_is_cap": 2.0})
    module.configure_model()
    before, watch = snapshot(module), Watch()
    try:
        make_trainer(tmp_path, limit_train_batches=steps, callbacks=[watch], logger=False).fit(module, datamodule=data)
    finally:
        server.shutdown()
    return module, before, watch, rollouts, server


def test_the_next_rollout_plays_during_the_update_with_the_weights_it_started_from(tmp_path):
    module, before, watch, rollouts, server = fit(tmp_path, 1)
    assert unchanged(module, before) != list(before)  # it trained
    assert [s["train/staleness"] for s in watch.stats] == [0.0, 1.0, 1.0]
    tasks = [t for t, _ in rollouts]
    # beside step k's update: step k+1's rollout, in the background; the last step has none ahead
    assert watch.in_flight == [tasks[1], tasks[2], None]
    assert [name.startswith("lit_marl_rollout_ahead") for _, name in rollouts] == [False, True, True]
    # step 0 and step 1 played the first weights (version 1); step 2 the weights after step 0's update:
    # sent before step 1's update began, so step 1 updated while they played
    assert [e for e in server.events if e.startswith("/finish")] == [
        "/finish_weight_update:1",
        "/finish_weight_update:2",
    ]
    assert server.generated_with == sorted(server.generated_with) and set(server.generated_with) == {"1", "2"}
    _, _, _, on_policy, _ = fit(tmp_path / "on_policy", 0)
    assert [t for t, _ in on_policy] == tasks  # the same tasks, in the same order: none skipped or repeated
    assert all(torch.isfinite(torch.tensor(float(v))) for v in module.trainer.callback_metrics.values())


def test_what_cannot_overlap_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="data.max_staleness=1: data.engine=auto generates with the trainer"):
        corridor_data(**SETTINGS, max_staleness=1)
    with pytest.raises(ConfigError, match="only 1"):
        corridor_data(**SETTINGS, engine="vllm_server", max_staleness=2)
    server = StandIn()
    try:
        options = {"servers": [server.url]}
        data = corridor_data(**SETTINGS, engine="vllm_server", engine_options=options, max_staleness=1)
        with pytest.raises(ConfigError, match="rollout_is_cap"):
            make_trainer(tmp_path, logger=False).fit(PPO(model="tiny-random"), datamodule=data)
        two = {"servers": [server.url, server.url]}  # one per model of the team
        data = slogan_data(engine="vllm_server", engine_options=two, max_staleness=1)
        with pytest.raises(ConfigError, match="MADPO samples others than its current agents"):
            make_trainer(tmp_path, logger=False).fit(MADPO(model="tiny-random", num_agents=2), datamodule=data)
    finally:
        server.shutdown()


def test_trees_overlap_too(tmp_path):
    """MAGRPO's joint trees (one shared model, so one server): the second step trains the rollout that
    played during the first update."""
    server = StandIn()
    try:
        data = slogan_data(engine="vllm_server", engine_options={"servers": [server.url]}, max_staleness=1)
        module = MAGRPO(model="tiny-random", num_agents=2, share_parameters=True, update={"rollout_is_cap": 2.0})
        stats = []
        record = L.Callback()
        record.on_train_batch_start = lambda trainer, pl_module, batch, batch_idx: stats.append(dict(batch.stats))
        make_trainer(tmp_path, callbacks=[record], logger=False).fit(module, datamodule=data)
    finally:
        server.shutdown()
    assert [s["train/staleness"] for s in stats] == [0.0, 1.0]
