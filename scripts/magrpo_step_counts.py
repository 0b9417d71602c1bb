"""Counts and times one MAGRPO training step on the tiny random model (2 agents): generate calls,
reward calls, transition calls, training forward/backward passes and optimizer steps, for each
tree shape.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python scripts/magrpo_step_counts.py

Prints one JSON line per configuration (median of --repeats steps after one warm-up).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from unittest import mock

import torch

import lit_marl.rollout.tree as tree
from lit_marl.algorithms import MAGRPO
from lit_marl.envs.base import FunctionEnv
from lit_marl.generation import Sampling, make_engine
from lit_marl.logprobs import completion_logits
from lit_marl.rollout.transitions import plain


def reward(agent_completions, tasks):
    return [float(sum(len(a[j]) for a in agent_completions) % 5) for j in range(len(tasks))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=1)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-4, max_grad_norm=0.0)
    module.configure_model()
    optimizers = module.configure_optimizers()
    module.optimizers = lambda: optimizers
    module.manual_backward = lambda loss: loss.backward()
    module.log = lambda *a, **k: None
    tasks = [{"id": i} for i in range(args.tasks)]
    prompts = [f"Task {{id}}: together write about the sea, agent {a}." for a in range(2)]
    counts = dict.fromkeys(("generate", "reward", "transition", "forward", "optimizer_step"), 0)

    def counted(name, fn):
        @functools.wraps(fn)  # keeps fn's name and signature, which error messages and checks read
        def wrapper(*a, **k):
            counts[name] += 1
            return fn(*a, **k)

        return wrapper

    engine = make_engine("auto")
    generate_team = engine.generate_team

    def counted_team(calls, *a, **k):  # one generate call per agent model, as the benchmark counts
        counts["generate"] += len(calls)
        return generate_team(calls, *a, **k)

    engine.generate_team = counted_team
    for joint_mode in ("aligned", "cross"):
        for num_turns in (1, 2):
            times = []
            update_agent = module.update_agent
            for repeat in range(args.repeats + 1):
                for key in counts:
                    counts[key] = 0
                with (
                    mock.patch(  # the update's training forward (MAGRPO.loss)
                        "lit_marl.algorithms.magrpo.completion_logits", counted("forward", completion_logits)
                    ),
                    mock.patch.object(module, "update_agent", counted("optimizer_step", update_agent)),
                ):
                    start = time.perf_counter()
                    env = FunctionEnv(prompts, counted("reward", reward), counted("transition", plain))
                    settings = tree.TreeSettings(
                        num_generations=args.num_generations,
                        joint_mode=joint_mode,
                        sampling=Sampling(max_new_tokens=args.max_new_tokens),
                        num_turns=num_turns,
                    )
                    batch = module.scored(tree.build_tree(list(module.agents), tasks, env, settings, engine))
                    for buffer, samples in zip(module.rollout_buffers, batch.agents):
                        buffer.add(module.advantages(samples))
                    module.flush_buffers()
                    if repeat:
                        times.append(time.perf_counter() - start)
            leaves = int(batch.stats[f"turn_{num_turns - 1}/nodes"]) * (
                args.num_generations if joint_mode == "aligned" else args.num_generations**2
            )
            print(
                json.dumps(
                    {
                        "joint_mode": joint_mode,
                        "num_turns": num_turns,
                        "G": args.num_generations,
                        "tasks": args.tasks,
                        "leaves": leaves,
                        "generated_tokens": int(batch.stats["perf/generated_tokens"]),
                        "generate_calls": counts["generate"],
                        "reward_calls": counts["reward"],
                        "transition_calls": counts["transition"],
                        # forward/backward passes (micro_batches: token budget, row cap; zero-advantage rows skipped)
                        "forward_backward_passes": counts["forward"],
                        "optimizer_steps": counts["optimizer_step"],
                        "step_s_median": round(statistics.median(times), 3),
                        "step_s_min": round(min(times), 3),
                    }
                )
            )


if __name__ == "__main__":
    main()
