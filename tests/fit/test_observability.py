"""What a run writes for TensorBoard, read back with TensorBoard's own event reader: the grouped
scalars, one rendered tree or episode as text, histograms of rewards and advantages."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import PLAIN, corridor_data, make_trainer, slogan_data
from lit_marl.algorithms import GRPO, MAGRPO
from lit_marl.metrics import StepLog

REPO_ROOT = Path(__file__).resolve().parents[2]


def _events(tmp_path) -> EventAccumulator:
    (run,) = {p.parent for p in (tmp_path / "lightning_logs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


def _text(events: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]


def test_tree_fit_writes_grouped_scalars_a_rendered_tree_and_histograms(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, log_samples_every_n_steps=2)
    data = slogan_data(
        sampling={"max_new_tokens": 16}, num_turns=2, transition=PLAIN, tasks_per_step=1, num_generations=2
    )
    trainer = make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    events = _events(tmp_path)

    scalars = set(events.Tags()["scalars"])
    expected = {
        # train/: the step, over every joint action of every turn
        *(f"train/reward{s}" for s in ("", "_std", "_min", "_max")),
        "train/loss",
        "train/success",
        "train/completion_len",
        "train/truncated_frac",
        "train/episodes",
        "train/tree_nodes",
        # turn_<k>/: per turn
        *(f"turn_{t}/{key}" for t in (0, 1) for key in ("reward", "reward_std", "reward_min", "reward_max")),
        *(f"turn_{t}/{key}" for t in (0, 1) for key in ("return", "nodes", "success")),
        # agent<i>/: per learner
        *(f"agent{i}/{key}" for i in (0, 1) for key in ("loss", "optimizer_steps", "advantage_abs", "completion_len")),
        *(f"agent{i}/{key}" for i in (0, 1) for key in ("advantage_std", "entropy")),
        # perf/: the time split and throughput
        *(f"perf/{key}" for key in ("generate_s", "reward_s", "transition_s", "train_s", "step_s")),
        *(f"perf/{key}" for key in ("tokens_per_s", "train_tokens", "train_tokens_per_s", "generated_tokens")),
    }
    assert expected <= scalars, sorted(expected - scalars)
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2, 3]  # x: training steps done
    # the reward's spread is over every joint action of the step: 2 nodes' worth at turn 1
    (first,) = [e for e in events.Scalars("turn_1/nodes") if e.step == 1]
    assert first.value == 2.0
    for e in events.Scalars("train/reward_std"):
        assert 0.0 <= e.value <= 0.5

    # steps 1 and 3 (every 2 steps, the first included): the first task's tree as Markdown
    samples = _text(events, "train/sample/text_summary")
    assert [step for step, _ in samples] == [1, 3]
    text = samples[0][1]
    for piece in ("turn 0, node `root`", "turn 1, node `root.0`", "turn 1, node `root.1`", "prompt of agent 1"):
        assert piece in text, text[:2000]
    assert text.count("- joint action") == 2 + 2 * 2  # G at the root, G at each of its G children
    assert "continues at `root.1`" in text and "ends" in text
    assert "reward **" in text

    histograms = set(events.Tags()["histograms"])
    assert {"train/reward", "turn_0/reward", "turn_1/reward", "agent0/advantage", "agent1/return"} <= histograms
    # the policy's entropy per response token: positive, at most log(vocabulary)
    vocabulary = module.agents[0].model.config.vocab_size
    assert all(0.0 < e.value <= math.log(vocabulary) for e in events.Scalars("agent0/entropy"))
    # 6 FLOPs per parameter of the learner's model and token its passes computed (both agents: one size)
    parameters = sum(p.numel() for p in module.agents[0].model.parameters())
    for flops, tokens in zip(events.Scalars("perf/train_flops"), events.Scalars("perf/train_tokens")):
        assert flops.value == pytest.approx(6 * parameters * tokens.value, rel=1e-5)
    (hist,) = [e for e in events.Histograms("train/reward") if e.step == 1]
    assert hist.histogram_value.num == 2 + 4  # every joint action of the step's tree: 2 at turn 0, 4 at turn 1


def test_episode_fit_writes_a_rendered_episode(tmp_path):
    L.seed_everything(0)
    module = GRPO(model="tiny-random", learning_rate=1e-3, log_samples_every_n_steps=1)
    data = corridor_data(
        tasks_per_step=2, num_generations=2, max_turns=3, sampling={"max_new_tokens": 6, "temperature": 1.5}
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    events = _events(tmp_path)
    scalars = set(events.Tags()["scalars"])
    expected = {"train/reward", "train/reward_std", "train/won", "train/turns", "turn_0/reward", "turn_0/episodes"}
    expected |= {"agent0/loss", "train/approx_kl", "train/clip_frac", "perf/generate_s", "perf/env_s", "perf/step_s"}
    assert expected <= scalars, sorted(expected - scalars)
    ((step, text),) = _text(events, "train/sample/text_summary")
    assert step == 1 and "**episode 0** of task 0" in text
    assert "- turn 0" in text and "agent 0 saw:" in text and "agent 0 replied:" in text
    assert {"train/reward", "train/advantage"} <= set(events.Tags()["histograms"])


def test_logging_every_n_steps_writes_those_steps_only(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, log_samples_every_n_steps=0)
    trainer = make_trainer(tmp_path, limit_train_batches=4, limit_val_batches=0, log_every_n_steps=2)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 4}, tasks_per_step=1, num_generations=2))
    events = _events(tmp_path)
    assert [e.step for e in events.Scalars("train/reward")] == [2, 4]
    assert not events.Tags()["histograms"] and "train/sample/text_summary" not in events.Tags()["tensors"]


# --------------------------------------------------------------------------- StepLog, one process
def test_step_log_reduces_by_kind():
    log = StepLog()
    log.add({"a": 1.0}, weight=1.0)
    log.add({"a": 4.0}, weight=3.0)  # the same key twice: a weighted mean over both records
    log.add({"hi": 2.0}, reduce="max")
    log.add({"hi": 5.0}, reduce="max")
    log.add({"n": 2.0}, reduce="sum")
    log.add({"n": 3.0}, reduce="sum")
    log.distribution("r", torch.tensor([0.0, 1.0]))
    log.distribution("r", torch.tensor([2.0]))
    scalars, distributions = log.reduce()
    assert scalars["a"] == pytest.approx((1 + 12) / 4) and scalars["hi"] == 5.0 and scalars["n"] == 5.0
    assert scalars["r"] == pytest.approx(1.0) and scalars["r_std"] == pytest.approx((2 / 3) ** 0.5)
    assert (scalars["r_min"], scalars["r_max"]) == (0.0, 2.0)
    assert distributions["r"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="'hi' is recorded with reduce='max' and 'mean'"):
        log.add({"hi": 1.0})


def test_the_epoch_end_flush_is_written_and_log_every_0_writes_no_step(tmp_path):
    """An update that fires only at the epoch's end (a buffer larger than the epoch) still logs its
    losses, whatever log_every_n_steps; log_every_n_steps 0 (Lightning: no step logging) writes no
    step's records and does not fail."""
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, buffer={"size": 1000}, log_samples_every_n_steps=0)
    trainer = make_trainer(tmp_path / "a", limit_train_batches=3, limit_val_batches=0, log_every_n_steps=2)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 4}, tasks_per_step=1, num_generations=2))
    events = _events(tmp_path / "a")
    assert [e.step for e in events.Scalars("train/reward")] == [2]
    assert [e.step for e in events.Scalars("agent0/loss")] == [3] and "train/reward" in module.step_metrics

    module = MAGRPO(model="tiny-random", num_agents=2, log_samples_every_n_steps=0)
    trainer = make_trainer(tmp_path / "b", limit_train_batches=2, limit_val_batches=0, log_every_n_steps=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 4}, tasks_per_step=1, num_generations=2))
    assert not list((tmp_path / "b").rglob("events.out.tfevents.*")) or "train/reward" not in set(
        _events(tmp_path / "b").Tags()["scalars"]
    )


def test_rollout_counts_are_summed_and_the_rest_averaged():
    from lit_marl.metrics import record_stats

    log = StepLog()
    stats = {"perf/generated_tokens": 10.0, "train/episodes": 4.0, "turn_1/nodes": 2.0, "train/completion_len": 5.0}
    record_stats(log, stats, 2.0)
    record_stats(log, {**stats, "train/completion_len": 8.0}, 1.0)  # a second rank's, say
    scalars, _ = log.reduce()
    assert scalars["perf/generated_tokens"] == 20.0 and scalars["train/episodes"] == 8.0
    assert scalars["turn_1/nodes"] == 4.0 and scalars["train/completion_len"] == pytest.approx(6.0)
