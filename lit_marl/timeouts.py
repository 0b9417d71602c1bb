"""A call bounded in time: user code (a reward function, a transition, a tool) runs in a daemon
thread and the caller stops waiting after its limit."""

from __future__ import annotations

import threading
from collections.abc import Callable


class TimedOut(Exception):
    """A call did not return within its time limit."""


def timed(fn: Callable, timeout_s: float | None, what: str, **kwargs):
    """``fn(**kwargs)``, but raise ``TimedOut`` when it has not returned after ``timeout_s`` seconds
    (None: wait for ever). Python cannot stop the thread: a call that never returns keeps it (and
    what it holds) until the process ends; the caller goes on or stops, as its policy says."""
    if timeout_s is None:
        return fn(**kwargs)
    box: dict = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as err:  # handed to the caller's thread
            box["error"] = err

    worker = threading.Thread(target=target, name=f"lit_marl {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimedOut(f"{what} did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
