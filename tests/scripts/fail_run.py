"""A 2-rank run in which rank 1 raises, for the rank-failure tests (Lightning re-launches it per rank).

python fail_run.py OUT --fail setup|rollout|update|none [--fsdp] [--steps 3] [--fail-step 1] [--fail-rank 1]
    [--timeout-s 120]

Rank 1 (``--fail-rank``) raises ``RuntimeError("injected <where> failure")`` while rank 0 goes on into its next
collective: in the module's ``setup`` (rank 0 waits at the barrier after setup, as when one rank
cannot start its generation engine), in the rollout of training step ``--fail-step`` (rank 0 rolls
out and waits in the update's first all-reduce), or in the update of that step, at the second
learner's optimizer step (rank 0 waits inside that step's all-reduce). Each rank writes its pid to
OUT/pid_rank{r}; rank 1 writes the moment it raises to OUT/failed_at. StepCheckpoint writes
OUT/checkpoints/last.ckpt after every step. The process group's timeout is ``--timeout-s``.

Rank 1 also starts a thread that never ends (as a generation engine's workers can): its process
cannot exit by itself after the error, so its connections stay open and rank 0 learns nothing from
gloo (a closed connection would fail rank 0's collective at once); that is the run that used to
hang until the process group's timeout. ``--fail none`` runs to the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402

from helpers import make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import MAGRPO  # noqa: E402
from lit_marl.callbacks import StepCheckpoint  # noqa: E402
from lit_marl.data import RolloutDataModule  # noqa: E402
from lit_marl.parallel.strategies import TeamDDPStrategy, TeamFSDPStrategy  # noqa: E402

ARGS = argparse.Namespace()


def fail_here(where: str, rank: int, step: int | None = None) -> None:
    if rank == ARGS.fail_rank and ARGS.fail == where and (step is None or step == ARGS.fail_step):
        (ARGS.out / "failed_at").write_text(repr(time.time()))
        raise RuntimeError(f"injected {where} failure")


class FailingMAGRPO(MAGRPO):
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.global_rank == ARGS.fail_rank and ARGS.fail != "none":  # an engine's worker, as vLLM's
            threading.Thread(target=threading.Event().wait, name="engine-worker").start()
        fail_here("setup", self.global_rank)

    def update_agent(self, index, *args, **kwargs):
        if index == 1:  # the first learner's step is done (with its all-reduces): rank 0 is inside the second's
            fail_here("update", self.global_rank, self.trainer.fit_loop.total_batch_idx)
        return super().update_agent(index, *args, **kwargs)


class FailingData(RolloutDataModule):
    def rollout(self, agents, tasks, greedy, *args, **kwargs):
        if not greedy:
            step = self.trainer.fit_loop.total_batch_idx + 1  # Lightning counts the batch after its transfer
            fail_here("rollout", self.trainer.global_rank, step)
        return super().rollout(agents, tasks, greedy, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fail", choices=["setup", "rollout", "update", "none"], required=True)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-step", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.parse_args(namespace=ARGS)
    ARGS.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    (ARGS.out / f"pid_rank{rank}").write_text(str(os.getpid()))
    L.seed_everything(0)
    module = FailingMAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    data = FailingData(**slogan_data(num_generations=2, sampling={"max_new_tokens": 4}, tasks_per_step=1).hparams)
    timeout = timedelta(seconds=ARGS.timeout_s)
    if ARGS.fsdp:
        strategy = TeamFSDPStrategy(mode="gathered", save_distributed_checkpoint=False, timeout=timeout)
    else:
        strategy = TeamDDPStrategy(timeout=timeout)
    trainer = make_trainer(
        ARGS.out,
        logger=False,
        devices=2,
        strategy=strategy,
        enable_checkpointing=True,
        limit_train_batches=ARGS.steps,
        limit_val_batches=0,
        callbacks=[StepCheckpoint(str(ARGS.out / "checkpoints"))],
    )
    trainer.fit(module, datamodule=data)
    (ARGS.out / f"done_rank{trainer.global_rank}").write_text("done")


if __name__ == "__main__":
    main()
