"""One rank's error stops every rank, at once, with its message printed once (lit_marl/parallel/failure.py).

Two gloo ranks (tests/scripts/fail_run.py); rank 1 raises in setup, in a rollout or in an update
while rank 0 goes on into its next collective, and rank 1's process cannot exit by itself (a thread
that never ends, as a generation engine's can), so nothing but lit_marl's failure report tells
rank 0. Before it, such a run waited for the process group's timeout (120 s here, 30 min by
default) and rank 1 never ended: these tests then fail 60 s after the error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TEST_SCRIPTS
from lit_marl import checkpoint_files

SCRIPT = TEST_SCRIPTS / "fail_run.py"


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its parent to read its status does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def failure_time(out: Path) -> float | None:
    """When rank 1 raised (None: not yet)."""
    try:
        return float((out / "failed_at").read_text())
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.parametrize(
    "where, fsdp",
    [("setup", True), ("rollout", False), ("update", False)],
    ids=["setup-fsdp", "rollout-ddp", "update-ddp"],
)
def test_one_rank_failing_stops_every_rank_within_seconds_with_its_error_once(tmp_path, where, fsdp):
    command = [sys.executable, str(SCRIPT), str(tmp_path), "--fail", where, "--timeout-s", "120"]
    # the failed rank's shutdown waits on a thread that never ends: ended 1 s after it starts (10 s by default)
    env = {**os.environ, "LIT_MARL_FAILURE_EXIT_S": "1"}
    started = time.time()
    run = subprocess.Popen(
        command + (["--fsdp"] if fsdp else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # rank 1 (Lightning's child) in the same process group: killed with it on a hang
    )
    while True:  # until every rank closed the pipes (every rank ended); a regression fails 60 s after the error
        try:
            output, _ = run.communicate(timeout=1)
            break
        except subprocess.TimeoutExpired:  # (communicate again loses no output)
            since = time.time() - (failure_time(tmp_path) or time.time())
            if since > 60 or time.time() - started > 300:
                os.killpg(run.pid, signal.SIGKILL)
                output, _ = run.communicate()
                pytest.fail(f"the ranks still ran {since:.0f} s after the error:\n{output[-3000:]}")
    pids = [int((tmp_path / f"pid_rank{r}").read_text()) for r in range(2)]
    while any(alive(pid) for pid in pids) and time.time() - started < 300:  # the pipes close as a process exits
        time.sleep(0.05)
    ended = time.time()
    failed_at = failure_time(tmp_path)
    assert failed_at is not None, output[-3000:]
    assert run.returncode != 0
    assert not any(alive(pid) for pid in pids)
    # measured on the 2-core CPU: rank 0 stops ~1 s after rank 1 raises, every rank has ended after ~2 s
    assert ended - failed_at < 30, f"the ranks ended {ended - failed_at:.1f} s after the failure"
    assert output.count(f"RuntimeError: injected {where} failure") == 1, output[-3000:]
    assert output.count("lit-marl: rank 1 of 2 failed, every rank stops:") == 1
    assert output.count("lit-marl: rank 0 stops: rank 1 failed\n") == 1
    assert "Traceback" in output and "[rank1]:" in output  # rank 1's own traceback, with its rank
    assert "Timed out" not in output and "[rank0]: Traceback" not in output  # rank 0 raised nothing of its own
    if where != "setup":  # the checkpoint of step 0 (the failure is in step 1), whole and readable
        path = tmp_path / "checkpoints" / "last.ckpt"
        checkpoint_files.verify(path)
        saved = checkpoint_files.load(path)
        assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 1
        assert len(saved["lit_marl"]["ranks"]) == 2
        assert not (tmp_path / "done_rank0").exists()
