"""The protocol of lit_marl/parallel/failure.py in one process, on a real TCPStore: which rank prints
what, who acknowledges, when a process ends. (The 2-rank runs: tests/distributed/test_rank_failure.py.)"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import PrefixStore, TCPStore

from lit_marl import ConfigError
from lit_marl.parallel import failure


class Ended(BaseException):
    """``os._exit`` in these tests, in the main thread: the process goes on, the caller unwinds."""


@pytest.fixture
def ranks(monkeypatch):
    """``make(rank)``: this process as ``rank`` of 2, on a fresh store (rank 1's view too, by ``other``)."""
    server = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = PrefixStore("default_pg", server)
    ended = []

    def exit_(code):
        ended.append((threading.current_thread().name, code))
        if threading.current_thread() is threading.main_thread():
            raise Ended  # (the watch thread returns after its os._exit)

    monkeypatch.setattr(failure.os, "_exit", exit_)
    monkeypatch.setattr(failure, "_end_within_grace", lambda rank, grace: None)  # not at pytest's own exit
    monkeypatch.setattr(failure, "_state", "running")
    monkeypatch.setattr(failure, "_critical", threading.Lock())  # an ending rank keeps it until its exit
    trainer = SimpleNamespace(state=SimpleNamespace(status="running"), loggers=[])
    strategy = SimpleNamespace(_lightning_module=SimpleNamespace(_trainer=trainer))

    def make(rank: int, poll: float = 0.05) -> failure._Watch:
        watch = failure._Watch(store.clone(), strategy, rank, 2, poll, 1.0)
        monkeypatch.setattr(failure, "_watch", watch)
        return watch

    return SimpleNamespace(make=make, store=store, ended=ended, trainer=trainer)


def test_the_first_rank_to_fail_prints_its_error_once_and_waits_for_the_others(ranks, capsys):
    watch = ranks.make(1)
    ranks.store.add(failure.SEEN, 1)  # rank 0 has seen it (its watch acknowledges before it ends)
    try:
        raise RuntimeError("the engine did not start")
    except RuntimeError as err:
        error = err
    failure.report(error)
    printed = capsys.readouterr().err
    assert printed.startswith("lit-marl: rank 1 of 2 failed, every rank stops:\n[rank1]: Traceback")
    assert printed.count("RuntimeError: the engine did not start") == 1
    assert ranks.store.get(failure.FAILED).decode() == "1\nRuntimeError: the engine did not start"
    assert ranks.store.check([failure.DONE])  # rank 0 (the store's host) may end now
    assert failure.reported(error) and not ranks.ended  # the exception goes on: Lightning's teardown, the caller
    failure.report(error)  # reported once
    assert capsys.readouterr().err == ""
    watch.stop(0)  # a later failure elsewhere does not end the rank that reported
    assert not ranks.ended


def test_a_rank_that_raises_after_another_failed_prints_one_line(ranks, capsys, monkeypatch):
    ranks.make(0)
    ranks.store.compare_set(failure.FAILED, "", "1\nConfigError: data.x: no such file")
    failure.use_short_form(lambda error: f"configuration error: {error}")
    try:
        with pytest.raises(Ended):
            failure.report(ConfigError("data.x: no such file"))
        assert capsys.readouterr().err == "lit-marl: rank 0 stops: rank 1 failed (rank 0 raised the same error)\n"
        ranks.store.set(failure.DONE, "1")
        monkeypatch.setattr(failure, "_state", "running")  # the same rank again, as if it had not ended
        monkeypatch.setattr(failure, "_critical", threading.Lock())
        with pytest.raises(Ended):
            failure.report(RuntimeError("Connection closed by peer"))
    finally:
        failure.use_short_form(lambda error: None)
    assert capsys.readouterr().err == (
        "lit-marl: rank 0 stops: rank 1 failed; rank 0 then raised RuntimeError: Connection closed by peer\n"
    )
    assert ranks.store.add(failure.SEEN, 0) == 2 and [code for _, code in ranks.ended] == [1, 1]


def test_the_watch_ends_its_process_only_while_a_trainer_call_runs(ranks, capsys):
    watch = ranks.make(0)
    ranks.trainer.state.status = "finished"  # between trainer calls: not even a look at the store
    ranks.store.compare_set(failure.FAILED, "", "1\nRuntimeError: boom")
    ranks.store.set(failure.DONE, "1")
    watch.start()
    time.sleep(0.3)
    assert watch.is_alive() and not ranks.ended
    with failure.critical():  # a checkpoint being renamed into place is finished first
        ranks.trainer.state.status = "running"
        time.sleep(0.3)
        assert not ranks.ended
    watch.join(5)
    assert ranks.ended == [("lit-marl-failure-watch", 1)]
    assert capsys.readouterr().err == "lit-marl: rank 0 stops: rank 1 failed\n"
    assert ranks.store.add(failure.SEEN, 0) == 1


def test_the_settings_are_seconds(monkeypatch):
    monkeypatch.setenv("LIT_MARL_FAILURE_POLL_S", "0.25")
    assert failure.poll_s() == 0.25
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("LIT_MARL_FAILURE_POLL_S", bad)
        with pytest.raises(ConfigError, match="LIT_MARL_FAILURE_POLL_S"):
            failure.poll_s()
