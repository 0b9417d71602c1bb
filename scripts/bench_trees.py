"""Benchmark: a MAGRPO joint tree's rollout with the lean engine keeping each node's KV cache for its
children (``kept_kv_gib`` > 0) against re-reading every prompt (0), alternating in one run.

The workload is ``scripts/bench_workload.py``'s (its tiny Qwen2 or ``--model``, 2 agents, its joint
reward); ``--transition workload`` is its next prompt (the task, the agent's last reply and the
partner's: the task's tokens are what a child shares with its parent), ``history`` appends each turn
to the agent's previous prompt (the whole branch's dialogue: the parent's prompt is the child's prefix).
Rollout only (no update). Prints one JSON line per repeat and setting and a summary per setting.

    .venv/bin/python scripts/bench_trees.py --num-turns 3 --num-generations 4 --joint-mode aligned
    .venv/bin/python scripts/bench_trees.py --transition history --model ~/.cache/lit_marl/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_workload as workload  # noqa: E402
import torch  # noqa: E402


def reward(agent_completions: list[list[str]], tasks: list[dict]) -> list[float]:
    return [workload.joint_reward([agent[j] for agent in agent_completions]) for j in range(len(tasks))]


def workload_transition(*, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    partners = [[c for k, c in enumerate(agent_completions) if k != i] for i in range(num_agents)]
    return [workload.next_prompt(prompt, agent_completions[i], partners[i]) for i in range(num_agents)]


def history_transition(*, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    return [
        f"{prompt_history_per_agent[i][-1]}\nYour reply: {agent_completions[i]}\nPartner: "
        f"{' | '.join(c for k, c in enumerate(agent_completions) if k != i)}\nRevise:"
        for i in range(num_agents)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the workload's tiny Qwen2)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--num-turns", type=int, default=3)
    parser.add_argument("--joint-mode", default="aligned", choices=["aligned", "cross"])
    parser.add_argument("--tasks", type=int, default=2, help="tasks per rollout")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--transition", default="workload", choices=["workload", "history"])
    parser.add_argument("--kept-kv-gib", type=float, nargs="+", default=[0.0, 4.0], help="0: re-read every prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from lit_marl.agents import Agent
    from lit_marl.data import RolloutDataModule
    from lit_marl.generation import TorchEngine
    from lit_marl.rollout.tree import build_tree

    torch.set_num_threads(args.threads)
    model = args.model or str(workload.default_model_folder())
    folder = Path(tempfile.mkdtemp(prefix="bench_trees_"))
    (folder / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in workload.tasks(args.tasks)))
    data = RolloutDataModule(
        train_path=str(folder / "train.jsonl"),
        agent_prompts=["{prompt}"] * 2,
        reward_fn="__main__:reward",
        tasks_per_step=args.tasks,
        num_generations=args.num_generations,
        joint_mode=args.joint_mode,
        sampling={"max_new_tokens": args.max_new_tokens},
        num_turns=args.num_turns,
        transition=f"__main__:{args.transition}_transition",
        early_termination_threshold=None,
    )
    agents = [Agent(model), Agent(model)]  # two models of the same weights, decoded stacked
    for agent in agents:
        agent.model.requires_grad_(False)
    results = []
    for repeat in range(args.repeats):
        for gib in args.kept_kv_gib:
            engine = TorchEngine(kept_kv_gib=gib)
            torch.manual_seed(repeat)
            with torch.no_grad(), engine.rollout(agents):
                batch = build_tree(agents, data.train_tasks[: args.tasks], data.env, data.tree, engine=engine)
            s = batch.stats
            line = {
                "repeat": repeat,
                "kept_kv_gib": gib,
                "nodes": int(s["train/tree_nodes"]),
                "generate_s": round(s["perf/generate_s"], 3),
                "generated_tokens": int(s["perf/generated_tokens"]),
                "prompt_tokens_reused": engine.prefill[0],
                "prompt_tokens_computed": engine.prefill[1],
            }
            results.append(line)
            print(json.dumps(line), flush=True)
    for summary in workload.medians_by(results, "kept_kv_gib"):
        print(json.dumps({"model": model, "transition": args.transition, **summary}))


if __name__ == "__main__":
    main()
