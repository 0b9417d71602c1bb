"""Exact resume: the task loader's position, the rollout buffers and the RNG states survive a
SIGKILL; a resumed run ends with the parameters of an uninterrupted one and sees the same tasks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TEST_SCRIPTS
from lit_marl.tasks import TaskLoader

SCRIPT = TEST_SCRIPTS / "resume_run.py"


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=300, env=os.environ
    )


@pytest.mark.parametrize("algorithm", ["magrpo", "iterative", pytest.param("iac", marks=pytest.mark.slow)])
def test_killed_run_resumes_exactly(tmp_path, algorithm):
    """4 steps straight vs. a run killed (SIGKILL) as its 4th step starts and resumed from the
    checkpoint of its 3rd. MAGRPO: the buffers fill over two steps, so that checkpoint holds waiting
    samples. Iterative MADPO: the kill lands in its second iteration, whose comparator is the
    snapshot of the policy as it began and whose pairs are drawn from both iterations' replay shards,
    by the comparator's own random stream (iac: ``make test-slow``)."""
    full = run(tmp_path / "full", "--steps", "4", "--algorithm", algorithm)
    assert full.returncode == 0, full.stderr[-2000:]
    cut = run(tmp_path / "cut", "--steps", "4", "--kill-before", "3", "--algorithm", algorithm)
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    assert not (tmp_path / "cut" / "params.pt").exists()
    checkpoint = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, weights_only=True)  # plain tensors: loads without pickled objects
    saved = state["lit_marl"]["ranks"][0]
    if algorithm == "iterative":
        assert saved["steps_done"] == 3 and len(saved["snapshots"]) == 2
        assert [s["iteration"] for s in saved["replay"]["shards"]] == [0, 0, 1], "the replay check is void"
    else:
        assert sum(b["num_nodes"] for b in saved["buffers"]) > 0, "the check of waiting samples is void"
    resumed = run(tmp_path / "cut", "--steps", "4", "--resume", str(checkpoint), "--algorithm", algorithm)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    tasks_full = (tmp_path / "full" / "tasks.jsonl").read_text().splitlines()
    tasks_cut = (tmp_path / "cut" / "tasks.jsonl").read_text().splitlines()
    assert len(tasks_full) == 4 and tasks_cut == tasks_full  # no task repeated, none skipped
    a = torch.load(tmp_path / "full" / "params.pt")
    b = torch.load(tmp_path / "cut" / "params.pt")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow  # three 2-rank runs (~1.5 min quiet, 3.5 min on a busy machine); `make test-slow`
def test_killed_fsdp_run_resumes_exactly(tmp_path):
    """The same under FSDP on 2 ranks: a sharded checkpoint (a folder, one file of shards per rank)
    and each rank's own tasks, RNG and buffers. (``make test`` keeps the FSDP checkpoint, resume and
    export run of tests/distributed and the kill-and-resume of one process.)"""
    full = run(tmp_path / "full", "--steps", "4", "--fsdp")
    assert full.returncode == 0, full.stderr[-2000:]
    cut = run(tmp_path / "cut", "--steps", "4", "--kill-before", "3", "--fsdp")
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    checkpoint = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_dir()
    resumed = run(tmp_path / "cut", "--steps", "4", "--resume", str(checkpoint), "--fsdp")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for name in ("tasks.jsonl", "tasks_rank1.jsonl"):
        tasks_full = (tmp_path / "full" / name).read_text().splitlines()
        assert len(tasks_full) == 4 and (tmp_path / "cut" / name).read_text().splitlines() == tasks_full
    a = torch.load(tmp_path / "full" / "params.pt")
    b = torch.load(tmp_path / "cut" / "params.pt")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- the task loader
def test_ranks_share_out_the_tasks_of_one_process():
    tasks = [{"i": i} for i in range(10)]
    single = list(TaskLoader(tasks, batch_size=4, seed=3))
    ranks = [list(TaskLoader(tasks, batch_size=2, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single) == 3  # 10 tasks padded to 12 on 2 ranks
    for step in range(2):  # the whole steps: rank 0 + rank 1 == the single process's batch
        assert ranks[0][step] + ranks[1][step] == single[step]
    seen = [t["i"] for rank in ranks for batch in rank for t in batch]
    assert sorted(set(seen)) == list(range(10))  # every task, two of them twice (padding)


def test_loader_resumes_after_the_consumed_batches_and_moves_on_at_epoch_end():
    tasks = [{"i": i} for i in range(9)]
    loader = TaskLoader(tasks, batch_size=2, seed=0)
    epoch0 = list(loader)
    epoch1 = list(loader)
    assert epoch0 != epoch1 and len(epoch0) == 5 and len(epoch0[-1]) == 1

    again = TaskLoader(tasks, batch_size=2, seed=0)
    iterator = iter(again)
    next(iterator), next(iterator), next(iterator)  # the fetcher ran one batch ahead ...
    again.consumed = 2  # ... of the two the training step received
    resumed = TaskLoader(tasks, batch_size=2, seed=0)
    resumed.load_state_dict(again.state_dict())
    assert list(resumed) == epoch0[2:]
    assert list(resumed) == epoch1  # the next epoch follows as in an uninterrupted run

    finished = TaskLoader(tasks, batch_size=2, seed=0)
    finished.load_state_dict({"epoch": 0, "consumed": 5, "epoch_done": True, "num_tasks": 9})  # at epoch end
    assert list(finished) == epoch1
    with pytest.raises(ValueError, match="same data.train_path"):
        finished.load_state_dict({"epoch": 0, "consumed": 1, "epoch_done": False, "num_tasks": 8})

    limited = TaskLoader(tasks, batch_size=2, seed=0)  # limit_train_batches=2: an epoch is 2 batches
    iterator = iter(limited)
    next(iterator), next(iterator)
    limited.consumed, limited.epoch_length = 2, 2
    assert limited.state_dict()["epoch_done"]
    resumed = TaskLoader(tasks, batch_size=2, seed=0)
    resumed.load_state_dict(limited.state_dict())
    assert list(resumed) == epoch1  # the next epoch, not the rest of epoch 0


def test_epoch_zero_keeps_the_order_of_torchs_data_loader():
    """Runs measured before the resumable loader (docs/quickstart.md) keep their task order."""
    from lit_marl.tasks import task_loader

    tasks = [{"i": i} for i in range(37)]
    assert list(TaskLoader(tasks, 4, seed=5)) == list(task_loader(tasks, 4, True, 5))
