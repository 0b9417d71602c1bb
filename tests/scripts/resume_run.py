"""One training run for the resume tests, in its own process so that it can be SIGKILLed.

python resume_run.py OUT --steps N [--kill-before K] [--resume CKPT] [--algorithm magrpo|iac|iterative]
    [--fsdp [gathered|per_layer|auto]] [--engine auto|vllm]

Writes OUT/tasks.jsonl (the task rows of every training step, in order, appended; rank r > 0 of an
``--fsdp`` run, 2 ranks with sharded checkpoints, writes tasks_rank{r}.jsonl) and, when the run
finishes, OUT/params.pt (every agent's parameters, full tensors). --kill-before K kills the process with
SIGKILL when training step K (0-based) is about to start, after the checkpoint of step K-1.
``--fsdp MODE`` picks ``TeamFSDPStrategy(mode=MODE)`` (``auto`` when no mode is given).
``--engine vllm`` rolls out with vLLM (its CPU build: run with .venv-vllm's python), each instance
with a small KV cache (the tiny model's 2048-token context needs 8 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from helpers import make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import IAC, MAGRPO, IterativeMADPO  # noqa: E402
from lit_marl.callbacks import StepCheckpoint  # noqa: E402
from lit_marl.data import RolloutDataModule  # noqa: E402
from lit_marl.parallel.strategies import TeamFSDPStrategy  # noqa: E402


def phase(out: Path, text: str) -> None:
    """Where the run is (for scripts/soak_kill_resume.py: which phase a kill interrupted)."""
    with open(out / "phases.log", "a") as f:
        f.write(text + "\n")


class Recorder(L.Callback):
    def __init__(self, out: Path, kill_before: int | None):
        self.out, self.kill_before = out, kill_before
        self.steps = 0  # training steps recorded; saved in the checkpoint (the steps it holds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill_before is not None and trainer.fit_loop.total_batch_idx == self.kill_before:
            os.kill(os.getpid(), signal.SIGKILL)
        name = "tasks.jsonl" if trainer.global_rank == 0 else f"tasks_rank{trainer.global_rank}.jsonl"
        with open(self.out / name, "a") as f:
            f.write(json.dumps(trainer.datamodule.current_tasks, sort_keys=True) + "\n")
        self.steps += 1
        phase(self.out, f"update {self.steps - 1}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        phase(self.out, f"checkpoint {self.steps - 1}")  # StepCheckpoint saves after the other callbacks

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class RecordingData(RolloutDataModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            self.current_tasks = batch
            # vLLM starts its instances in a process's first rollout: a phase of its own
            starting = getattr(self.engine, "backends", None) == {}
            phase(Path(self.trainer.default_root_dir), "vllm-start+rollout" if starting else "rollout")
        return super().on_before_batch_transfer(batch, dataloader_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill-before", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--algorithm", default="magrpo")
    parser.add_argument("--fsdp", nargs="?", const="auto", choices=["gathered", "per_layer", "auto"])
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    if args.algorithm == "magrpo":
        module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, buffer={"size": 3})
        data_kwargs = dict(num_generations=2, sampling={"max_new_tokens": 12}, tasks_per_step=2)
    elif args.algorithm == "iterative":  # 2 iterations of 2 steps: the kill lands inside the second
        module = IterativeMADPO(
            model="tiny-random",
            num_agents=2,
            learning_rate=1e-2,
            num_iterations=2,
            steps_per_iteration=2,
            comparator_policy="history",
            comparator_history_k=1,
            preference_replay_mode="lambda_decay",
            preference_replay_lambda=0.5,
        )
        data_kwargs = dict(num_generations=4, sampling={"max_new_tokens": 12}, tasks_per_step=2)
    else:
        module = IAC(model="tiny-random", num_agents=2, learning_rate=1e-2, buffer={"size": 6})
        data_kwargs = dict(
            num_generations=1,
            num_turns=2,
            transition="lit_marl.rollout.transitions:plain",
            sampling={"max_new_tokens": 12},
            tasks_per_step=2,
        )
    if args.engine == "vllm":  # 2 models x 2 ranks: 4 instances, each vLLM's CPU default of 1 GiB otherwise
        data_kwargs.update(engine="vllm", engine_options={"kv_cache_memory_bytes": 64 << 20})
    base = slogan_data(**data_kwargs)
    data = RecordingData(**base.hparams)
    trainer = make_trainer(
        args.out,
        logger=False,
        enable_checkpointing=True,
        limit_train_batches=args.steps,
        limit_val_batches=0,
        callbacks=[Recorder(args.out, args.kill_before), StepCheckpoint(str(args.out / "checkpoints"))],
        **(dict(devices=2, strategy=TeamFSDPStrategy(mode=args.fsdp)) if args.fsdp else {}),
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    params = {
        f"{i}.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for i, a in enumerate(module.agents)
        for n, p in a.model.named_parameters()
    }
    if trainer.is_global_zero:
        torch.save(params, args.out / "params.pt")


if __name__ == "__main__":
    main()
