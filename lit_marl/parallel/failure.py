"""One rank's error stops every rank, at once, with its message printed once.

Ranks meet in collectives (all-reduces, barriers, FSDP's all-gathers). A rank that raises leaves the
others waiting in their next one until the process group's timeout (30 min by default), and for
ever where the failed process does not exit (a generation engine's threads can keep it alive).
Launchers differ in what they do about a failed process (Lightning's own kills its children within
5 s, torchrun tears its workers down; ranks on other nodes learn nothing), so lit_marl's strategies
(``parallel/strategies.py``) use what every rank of every node reaches: the process group's
key-value store (a ``TCPStore``, through a connection of this module's own, since a store client
blocks while another thread waits on it).

- ``watch``: once the process group exists, a daemon thread on every rank checks the key
  ``lit_marl/failed`` every ``LIT_MARL_FAILURE_POLL_S`` seconds (1 s) while a trainer call (fit,
  validate, test) runs on the rank. Seeing another rank's failure, it prints one line, flushes the
  trainer's loggers and ends the process with ``os._exit(1)``: its main thread may be blocked inside
  a gloo or NCCL collective, which no exception interrupts. A checkpoint being renamed into place
  (``critical``) is finished first.
- ``report`` (Lightning's ``Strategy.on_exception``, on the rank that raised): the first rank to set
  the key (an atomic compare-and-set) prints its error once (rank, type, message, traceback),
  waits until the other ranks have seen it (at most a few polls: the store lives in rank 0's
  process), and lets the exception go on as usual (Lightning's teardown, its loggers' ``failed``
  status, the caller's ``except``); Python's own print of it at exit is skipped. A rank that raises
  after another rank failed (often a consequence) prints one line and ends like a watched one.
- the failed process gets ``LIT_MARL_FAILURE_EXIT_S`` seconds (10 s) from the start of its
  interpreter's shutdown, then ends: a thread that never ends must not keep the process, and with
  it the other ranks' connections, alive.

``LIT_MARL_FAILURE_POLL_S=0`` turns all of this off. A rank killed outright (SIGKILL, the OOM
killer) cannot report: there the launcher's handling or the process group's timeout applies.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from lit_marl import ConfigError

FAILED = "lit_marl/failed"  # "<rank>\n<Type: message>" of the first rank that failed
SEEN = "lit_marl/failure_seen"  # how many other ranks have seen it
DONE = "lit_marl/failure_done"  # the failed rank read SEEN for the last time
STORE_TIMEOUT = timedelta(seconds=30)  # any one store call (they are not blocking waits)

_watch: _Watch | None = None
_state = "running"  # or "failing" (this rank reported) or "stopping" (another rank failed)
_state_lock = threading.Lock()
_critical = threading.Lock()
_short_form: Callable[[BaseException], str | None] = lambda error: None  # noqa: E731


def setting(name: str, default: float) -> float:
    """A non-negative number of seconds from the environment variable ``name``."""
    text = os.environ.get(name, "")
    try:
        value = float(text) if text.strip() else default
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"{name}={text!r}: give a number of seconds >= 0")
    return value


def poll_s() -> float:
    return setting("LIT_MARL_FAILURE_POLL_S", 1.0)


def use_short_form(form: Callable[[BaseException], str | None]) -> None:
    """How a failed rank prints an error: ``form(error)`` gives one line (the CLI's for a
    configuration error) or None for the traceback."""
    global _short_form
    _short_form = form


@contextmanager
def critical() -> Iterator[None]:
    """A block (no collective in it) that a stop waits for: a checkpoint renamed into place."""
    with _critical:
        yield


def reported(error: BaseException) -> bool:
    """Whether ``error`` was printed by ``report`` already (its process prints it no more)."""
    return getattr(error, "_lit_marl_reported", False)


class _Watch(threading.Thread):
    def __init__(self, store, strategy, rank: int, world_size: int, poll: float, grace: float):
        super().__init__(name="lit-marl-failure-watch", daemon=True)
        self.store, self.strategy, self.rank, self.world_size = store, strategy, rank, world_size
        self.poll, self.grace = poll, grace
        self.gone = False  # the store is unreachable (its host, rank 0's process, has ended)

    def running(self) -> bool:
        """Whether a trainer call runs on this rank (between calls no rank waits in a collective of ours)."""
        module = getattr(self.strategy, "_lightning_module", None)
        trainer = getattr(module, "_trainer", None)
        return trainer is not None and trainer.state.status == "running"

    def run(self) -> None:
        while True:
            time.sleep(self.poll)
            if not self.running():
                continue
            try:
                if not self.store.check([FAILED]):
                    continue
                failed = self.store.get(FAILED).decode()
            except Exception:  # the store is gone with rank 0's process (a run that ended): nothing to watch
                self.gone = True
                return
            rank = int(failed.split("\n", 1)[0])
            if rank != self.rank:
                self.stop(rank)
            return

    def stop(self, failed: int) -> None:
        """Another rank failed: end this process, unless this rank is reporting or ending already."""
        global _state
        with _state_lock:
            if _state != "running":
                return
            _state = "stopping"
        self.end(failed)

    def end(self, failed: int, detail: str = "") -> None:
        """One line, the failure acknowledged, a rename finished, the loggers flushed, ``os._exit(1)``."""
        try:
            self.store.add(SEEN, 1)
        except Exception:
            pass
        _critical.acquire(timeout=60)
        sys.stderr.write(f"lit-marl: rank {self.rank} stops: rank {failed} failed{detail}\n")
        _bounded(lambda: _flush_logs(self.strategy), 5.0)
        if self.rank == 0:  # the store lives in this process: kept until the failed rank is done with it
            _bounded(lambda: self.store.wait([DONE], timedelta(seconds=2)), 3.0)
        os._exit(1)


def watch(strategy) -> None:
    """Start this rank's watch (the process group exists; ``strategy``'s trainer calls are watched)."""
    global _watch
    poll, grace = poll_s(), setting("LIT_MARL_FAILURE_EXIT_S", 10.0)
    if poll == 0 or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    if _watch is not None and _watch.is_alive():
        _watch.strategy = strategy
        return
    try:
        store = dist.distributed_c10d._get_default_store().clone()  # a connection of its own
        store.set_timeout(STORE_TIMEOUT)
    except Exception as err:  # a process group without a store that clones (MPI)
        warnings.warn(f"lit-marl: a failing rank cannot stop the others here (its store: {err!r})", stacklevel=2)
        return
    _watch = _Watch(store, strategy, dist.get_rank(), dist.get_world_size(), poll, grace)
    _watch.start()
    if not getattr(sys.excepthook, "_lit_marl", False):
        sys.excepthook = _skipping_reported(sys.excepthook)


def report(error: BaseException) -> None:
    """This rank raised ``error`` in a trainer call: stop every rank (see the module's docstring)."""
    global _state
    watching = _watch
    if watching is None or reported(error):
        return
    with _state_lock:
        state = _state
        if state == "running":
            _state = "failing"
    if state == "stopping":  # the watch is ending this process: another rank failed first
        time.sleep(120)
    if state != "running":  # reported already
        return
    summary = _summary(error)
    first = mine = f"{watching.rank}\n{summary}"
    try:
        if not watching.gone:
            first = watching.store.compare_set(FAILED, "", mine).decode()
    except Exception:  # the store is gone (its host, rank 0's process, was killed): report here
        watching.gone = True
    rank, _, first_summary = first.partition("\n")
    if int(rank) != watching.rank:  # another rank failed first: this error is likely its consequence
        with _state_lock:
            _state = "stopping"
        me, same = watching.rank, first_summary == summary
        watching.end(int(rank), f" (rank {me} raised the same error)" if same else f"; rank {me} then raised {summary}")
    _print(error, watching.rank, watching.world_size)
    _mark_reported(error)
    _bounded(lambda: _flush_logs(watching.strategy), 5.0)
    _wait_until_seen(watching)
    _end_within_grace(watching.rank, watching.grace)


def _summary(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _print(error: BaseException, rank: int, world_size: int) -> None:
    head = f"lit-marl: rank {rank} of {world_size} failed, every rank stops"
    if isinstance(error, KeyboardInterrupt):
        sys.stderr.write(f"{head}: interrupted (KeyboardInterrupt)\n")
    elif (short := _short_form(error)) is not None:
        sys.stderr.write(f"{head}: {short}\n")
    else:
        lines = "".join(traceback.format_exception(error)).rstrip("\n").split("\n")
        sys.stderr.write(head + ":\n" + "".join(f"[rank{rank}]: {line}\n" for line in lines))
    sys.stderr.flush()


def _mark_reported(error: BaseException) -> None:
    try:
        error._lit_marl_reported = True
    except AttributeError:  # an exception type without attributes: printed once more at exit
        pass


def _wait_until_seen(watching: _Watch) -> None:
    """Until every other rank has seen the failure (the store lives in rank 0's process), a few polls at most."""
    deadline = time.monotonic() + max(5.0, 3 * watching.poll)
    if watching.gone:
        return
    try:
        while time.monotonic() < deadline and watching.store.add(SEEN, 0) < watching.world_size - 1:
            time.sleep(0.05)
        watching.store.set(DONE, "1")
    except Exception:  # the store is gone
        pass


def _end_within_grace(rank: int, grace: float) -> None:
    """From the start of the interpreter's shutdown, ``grace`` seconds until the process ends
    (threads that never end, exit handlers that wait, a process group's destructor)."""
    shutting_down = threading.Event()

    def end() -> None:
        shutting_down.wait()
        time.sleep(grace)
        sys.stderr.write(f"lit-marl: rank {rank} did not finish its shutdown within {grace:g} s: ended\n")
        sys.stderr.flush()
        os._exit(1)

    def on_shutdown() -> None:  # before Python joins the threads that are left
        shutting_down.set()
        if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():  # past Python code too
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(math.ceil(grace) + 5)

    threading.Thread(target=end, name="lit-marl-failure-exit", daemon=True).start()
    getattr(threading, "_register_atexit", lambda f: None)(on_shutdown)


def _skipping_reported(previous):
    def hook(kind, value, tb):
        if value is None or not reported(value):  # printed by report: once is enough
            previous(kind, value, tb)

    hook._lit_marl = True
    return hook


def _bounded(fn: Callable[[], None], seconds: float) -> None:
    """``fn()`` in a daemon thread, waited for at most ``seconds`` (a logger that blocks must not hold the stop)."""
    thread = threading.Thread(target=lambda: _quietly(fn), daemon=True)
    thread.start()
    thread.join(seconds)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        pass


def _flush_logs(strategy) -> None:
    """What the trainer's loggers hold in memory, to disk (a process about to end without Lightning's teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    trainer = getattr(getattr(strategy, "_lightning_module", None), "_trainer", None)
    for logger in getattr(trainer, "loggers", None) or []:
        experiment = getattr(logger, "_experiment", None)  # never created here (rank 0's loggers have one)
        if experiment is not None and hasattr(experiment, "flush"):
            _quietly(experiment.flush)
        _quietly(logger.save)
