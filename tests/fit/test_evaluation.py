"""The before/after held-out evaluation callback in a tiny fit."""

from __future__ import annotations

import lightning as L
import pytest

from helpers import make_trainer, slogan_data
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.callbacks import HeldOutEvaluation


def test_heldout_evaluation_prints_before_and_after(tmp_path, capsys):
    L.seed_everything(0)
    callback = HeldOutEvaluation(metric="success")
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    data = slogan_data(max_new_tokens=4, eval_tasks_per_step=32)
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
        trainer.fit(module, datamodule=slogan_data(max_new_tokens=2, eval_tasks_per_step=32))


def test_missing_heldout_tasks_fail_before_models_load(tmp_path):
    module = MAGRPO(model="tiny-random", num_agents=2)
    trainer = make_trainer(tmp_path, callbacks=[HeldOutEvaluation()])
    with pytest.raises(ConfigError, match="data.val_path"):
        trainer.fit(module, datamodule=slogan_data(val_path=None))
    assert module.agents is None
