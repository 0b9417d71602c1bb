"""The before/after held-out evaluation callback in a tiny fit."""

from __future__ import annotations

import lightning as L
import pytest

from helpers import PLAIN, make_trainer, slogan_data
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.callbacks import HeldOutEvaluation


def test_heldout_evaluation_prints_before_and_after(tmp_path, capsys):
    L.seed_everything(0)
    callback = HeldOutEvaluation(metric="success")
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    data = slogan_data(sampling={"max_new_tokens": 4}, eval_tasks_per_step=32)
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, datamodule=data)
    out = capsys.readouterr().out
    assert "[held-out, before training]" in out
    assert "[held-out, after training]" in out
    line = next(line for line in out.splitlines() if line.startswith("Held-out success (greedy): before "))
    before, after = line.split("before ")[1].split(" -> after ")
    assert float(before) == pytest.approx(callback.before["success"], abs=5e-4)
    assert float(after) == pytest.approx(callback.after["success"], abs=5e-4)
    for results in (callback.before, callback.after):
        assert {"reward", "success", "distinct", "length_ok"} <= set(results)
        assert all(0.0 <= v <= 1.0 for v in results.values())
    assert "TensorBoard logs:" in out
    # the before -> after table has a row per metric, and the first 3 tasks' answers follow
    rows = {line.split()[0]: line.split() for line in out.splitlines() if " ->  " in line and "before" not in line}
    assert set(rows) == {k for k in callback.after if not k.startswith("turn_")}
    assert float(rows["success"][1]) == pytest.approx(callback.before["success"], abs=5e-4)
    assert float(rows["reward"][3]) == pytest.approx(callback.after["reward"], abs=5e-4)
    assert "The first 3 held-out tasks, before -> after:" in out
    assert len(callback.before_examples) == len(data.examples) == len(data.val_tasks)
    for old, new in zip(callback.before_examples[:3], data.examples[:3]):
        assert old["task"] is new["task"]
        assert f"({old['task']['id']})" in out
        for example in (old, new):
            assert len(example["lines"]) == 2 and 0.0 <= example["reward"] <= 1.0
            shown = " ⏎ ".join(line.strip() for line in example["lines"][1].strip().splitlines())
            assert f"agent 1: {shown}" in out
    assert f"({data.val_tasks[3]['id']})" not in out
    # "before" is the greedy evaluation of the untrained agents
    fresh = MAGRPO(model="tiny-random", num_agents=2)
    fresh.configure_model()
    assert callback.before == pytest.approx(data.evaluate(fresh.agents))
    assert callback.after == pytest.approx(data.evaluate(module.agents))


def test_heldout_evaluation_rejects_unknown_metric(tmp_path):
    module = MAGRPO(model="tiny-random", num_agents=2)
    trainer = make_trainer(
        tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False, callbacks=[HeldOutEvaluation("accuracy")]
    )
    with pytest.raises(ValueError, match=r"HeldOutEvaluation\.metric='accuracy' is not reported"):
        trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 2}, eval_tasks_per_step=32))


def test_missing_heldout_tasks_fail_before_models_load(tmp_path):
    module = MAGRPO(model="tiny-random", num_agents=2)
    trainer = make_trainer(tmp_path, callbacks=[HeldOutEvaluation()])
    with pytest.raises(ConfigError, match="data.val_path"):
        trainer.fit(module, datamodule=slogan_data(val_path=None))
    assert module.agents is None


def test_periodic_sampled_evaluation_with_pass_at_k(tmp_path, capsys):
    """Every 2 steps (and before, after): 4 samples per held-out task, pass@1/2/4 from their
    ``success``; logged as eval/<metric> at the training steps done."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    L.seed_everything(0)
    callback = HeldOutEvaluation(metric="pass@4", every_n_steps=2, num_samples=4, pass_at_k=[1, 2, 4])
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    data = slogan_data(sampling={"max_new_tokens": 4}, eval_tasks_per_step=32)
    trainer = make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=0, callbacks=[callback])
    trainer.fit(module, datamodule=data)
    assert [step for step, _ in callback.history] == [0, 2, 3]  # before, after step 2, after training
    for _, results in callback.history:
        # pass@k grows with k, and pass@1 is the mean success of the samples
        assert 0.0 <= results["pass@1"] <= results["pass@2"] <= results["pass@4"] <= 1.0
        assert results["pass@1"] == pytest.approx(results["success"])
    out = capsys.readouterr().out
    assert "[held-out, after 2 steps] evaluating" in out and "Held-out pass@4 (4 samples per task)" in out
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/pass@2")] == [0, 2, 3]


def test_pass_at_k_settings_are_checked():
    with pytest.raises(ConfigError, match=r"pass_at_k=\[8\] needs num_samples >= 8 \(got 4\)"):
        HeldOutEvaluation(num_samples=4, pass_at_k=[8])
    with pytest.raises(ConfigError, match="every k must be >= 1"):
        HeldOutEvaluation(num_samples=4, pass_at_k=[0])


def test_sampled_leaves_are_counted_per_task_when_branches_end_early(tiny_agents):
    """Task 0 succeeds at once and early termination ends its tree after turn 0 (G leaves); the
    other tasks go on to turn 1 (G^2 leaves) and fail: the counts stay with their own tasks."""
    data = slogan_data(
        reward_fn="helpers:task_zero_wins", num_turns=2, transition=PLAIN, early_termination_threshold=0.5
    )
    tasks = data.val_tasks[:3]
    samples, correct = data.evaluation_metrics(tiny_agents, tasks, num_samples=2).successes
    assert samples.tolist() == [2, 4, 4] and correct.tolist() == [2, 0, 0]
