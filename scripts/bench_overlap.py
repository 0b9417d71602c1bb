"""Training steps per minute with rollouts generated during the update (``data.max_staleness: 1``) against
on-policy alternation (``0``), on a vLLM server (``data.engine: vllm_server``) and a game whose every
turn waits (a simulated slow tool: Corridor with a sleep in each step).

    make vllm
    .venv-vllm/bin/python scripts/bench_overlap.py --steps 6 --repeats 2 --turn-sleep 0.5

One server for every fit (started here, the address given to each fit), PPO on Corridor with
``rollout_is_cap`` 2.0; the settings alternate within each repeat (0, 1, 0, 1, ...). Each fit's time
counts from the end of its first step (which rolls out on the spot in both settings) to the end of
its last. Prints one JSON line per fit (steps per minute, each step's staleness, the last step's
importance-ratio and time-split metrics) and a summary line per setting (medians) with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=6, help="training steps per fit")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--turn-sleep", type=float, default=0.5, help="seconds each game turn waits")
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()

    import lightning as L
    import torch

    from lit_marl.agents import Agent
    from lit_marl.algorithms import PPO
    from lit_marl.data import EpisodeDataModule
    from lit_marl.envs.corridor import Corridor
    from lit_marl.generation.server import ServerSettings
    from lit_marl.generation.server_http import ServerClient
    from lit_marl.generation.server_process import start_server
    from lit_marl.generation.transfer import GLOO_BACKEND, free_port

    class SlowCorridor(Corridor):
        """Corridor whose every turn waits (a tool call on the far side of a network)."""

        def play(self, actions):
            time.sleep(args.turn_sleep)
            return super().play(actions)

    settings = ServerSettings(server_args={"max_model_len": 2048, "max_num_seqs": 32})
    config = Agent(args.model).model.config
    server = start_server(config, settings, "float32", GLOO_BACKEND, "cpu", free_port())
    server.wait_healthy(ServerClient(server.url, 60.0), 1200)

    class Clock(L.Callback):
        def __init__(self):
            self.ends, self.staleness = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.staleness.append(batch[0].stats.get("train/staleness", 0.0))

        def on_train_batch_end(self, trainer, *rest):
            self.ends.append(time.perf_counter())

    results: dict[int, list[float]] = {0: [], 1: []}
    try:
        for repeat in range(args.repeats):
            for staleness in (0, 1):
                torch.manual_seed(repeat)
                data = EpisodeDataModule(
                    train_path=str(REPO / "data" / "corridor" / "train.jsonl"),
                    env=SlowCorridor(),
                    tasks_per_step=args.tasks_per_step,
                    num_generations=1,
                    max_turns=args.max_turns,
                    sampling={"max_new_tokens": 8},
                    engine="vllm_server",
                    engine_options={"servers": [server.url]},
                    max_staleness=staleness,
                )
                module = PPO(model=args.model, update={"rollout_is_cap": 2.0})
                clock = Clock()
                trainer = L.Trainer(
                    accelerator="cpu",
                    max_epochs=1,
                    limit_train_batches=args.steps,
                    limit_val_batches=0,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[clock],
                )
                trainer.fit(module, datamodule=data)
                per_minute = 60 * (len(clock.ends) - 1) / (clock.ends[-1] - clock.ends[0])
                results[staleness].append(per_minute)
                logged = trainer.callback_metrics
                metrics = {k: float(f"{float(v):.4g}") for k, v in logged.items() if "rollout" in k or "perf/" in k}
                line = {"repeat": repeat, "max_staleness": staleness, "steps_per_minute": round(per_minute, 3)}
                line["staleness_per_step"] = clock.staleness
                print(json.dumps(line | metrics), flush=True)
    finally:
        server.stop()
    on, off = statistics.median(results[0]), statistics.median(results[1])
    print(
        f"median steps/min: max_staleness 0 {on:.2f}, max_staleness 1 {off:.2f}, ratio {off / on:.2f} "
        f"({args.steps} steps a fit, {args.turn_sleep} s a turn, {args.repeats} repeats)"
    )


if __name__ == "__main__":
    sys.exit(main())
