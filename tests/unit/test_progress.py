"""The run's progress bar: a rate and ETA from whole steps, the time cap, what the run is doing."""

from __future__ import annotations

from types import SimpleNamespace

from lightning.pytorch.callbacks import RichProgressBar, Timer, TQDMProgressBar

import lit_marl.callbacks.progress as progress
from lit_marl.callbacks import RunProgressBar
from lit_marl.callbacks.progress import RunTimeColumn, use_run_progress_bar


def _bar(monkeypatch, now: float, steps: int, total: int = 40, cap: float | None = None) -> RunProgressBar:
    bar = RunProgressBar()
    callbacks = []
    if cap is not None:
        timer = Timer(duration="00:00:10:00")
        monkeypatch.setattr(timer, "time_remaining", lambda: cap)
        callbacks.append(timer)
    done = SimpleNamespace(processed=steps)
    bar._trainer = SimpleNamespace(
        max_epochs=1,
        num_training_batches=total,
        callbacks=callbacks,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(total=done))),
    )
    bar.started, bar.first_step = 0.0, 0
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now)
    return bar


def _render(bar: RunProgressBar, elapsed: float = 600.0) -> str:
    task = SimpleNamespace(finished=False, elapsed=elapsed, finished_time=None)
    return str(RunTimeColumn(bar, style="").render(task))


def test_slow_steps_get_a_rate_and_an_eta(monkeypatch):
    """10 steps of 60 s: Lightning's bar shows 0.00it/s and -:--:--; this one 60 s/step and the
    30 steps left at that rate."""
    bar = _bar(monkeypatch, now=600.0, steps=10)
    assert bar.estimate() == (60.0, 1800.0, False)
    assert _render(bar) == "0:10:00 • 0:30:00 • 60.0 s/step"


def test_the_time_cap_bounds_the_eta(monkeypatch):
    bar = _bar(monkeypatch, now=600.0, steps=10, cap=300.0)
    assert bar.estimate() == (60.0, 300.0, True)
    assert _render(bar) == "0:10:00 • 0:05:00 (time cap) • 60.0 s/step"
    # a cap further away than the steps left does not bind
    assert _bar(monkeypatch, now=600.0, steps=10, cap=4000.0).estimate() == (60.0, 1800.0, False)


def test_fast_steps_and_before_the_first_step(monkeypatch):
    assert _render(_bar(monkeypatch, now=2.0, steps=8)).endswith("4.00 steps/s")
    assert _render(_bar(monkeypatch, now=2.0, steps=0)) == "0:10:00 • -:--:-- • -- s/step"


def test_metrics_show_phase_reward_and_tokens_per_s(monkeypatch):
    bar = RunProgressBar()
    monkeypatch.setattr(RichProgressBar, "get_metrics", lambda self, trainer, module: {"v_num": 3})
    module = SimpleNamespace(
        phase="rl", step_metrics={"train/reward": 0.5, "train/loss": 0.25, "perf/tokens_per_s": 812.4}
    )
    assert bar.get_metrics(None, module) == {"loss": "0.250", "reward": "0.500", "tok/s": "812"}
    module = SimpleNamespace(phase="sft", step_metrics={"train/sft_loss": 1.5})
    assert bar.get_metrics(None, module) == {"loss": "1.500"}


def test_the_cli_default_bar_is_replaced_and_a_configured_one_kept():
    default = SimpleNamespace(callbacks=[RichProgressBar()])
    assert type(use_run_progress_bar(default).callbacks[0]) is RunProgressBar
    configured = SimpleNamespace(callbacks=[TQDMProgressBar()])
    assert type(use_run_progress_bar(configured).callbacks[0]) is TQDMProgressBar


def test_lit_marl_fit_uses_it():
    from lit_marl.cli import build_cli

    cli = build_cli(args=["--config", "configs/magrpo/slogan_tiny.yaml"], run=False)  # run=False: no subcommand
    assert isinstance(cli.trainer.progress_bar_callback, RunProgressBar)
