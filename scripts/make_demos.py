"""Expert trajectories -> an SFT dataset (JSONL rows loadable by ``datasets``; ``lit_marl/rollout/demos.py``).

Any environment that has an expert (``demonstration(task)``: the Corridor game's optimal play, the
code environment's canonical solutions split into helper and main) turns task rows into
demonstrations. The demonstration tasks must be disjoint from the RL and evaluation tasks: every
file given with ``--exclude`` is compared by task id and by content (the row without its id), and
an overlap is an error (``--drop-overlap`` leaves those tasks out instead). Single-turn
demonstrations of a text environment are scored with its own reward in one batched call and kept
only at ``--min-reward`` or above; a stateful environment's expert must win the episode it plays.

    python scripts/make_demos.py --env corridor --tasks data/corridor/demo_tasks.jsonl \\
        --exclude data/corridor/train.jsonl data/corridor/heldout.jsonl --out data/corridor/demos.jsonl
    python scripts/make_demos.py --env lit_marl.envs.code:CodeEnv --env-kwargs '{"roles": "aux_main"}' \\
        --tasks humaneval --exclude data/code/easy_train.jsonl data/code/easy_heldout.jsonl \\
        --out data/code/demos_aux_main.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.envs import make_env
from lit_marl.envs.base import TextEnv
from lit_marl.tasks import import_object


def build_env(spec: str, kwargs: dict):
    """A registered environment's name, or ``module:Class`` of an environment (its settings nested as in YAML)."""
    if ":" not in spec:
        return make_env(spec, kwargs, "--env")
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(import_object(spec, "--env"), "env")  # nested settings as in a YAML config
    return parser.instantiate(parser.parse_object({"env": kwargs})).env


def task_rows(env, source: str, field: str) -> list[dict]:
    return env.load_tasks(source, field)


def content(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "task_id"}, sort_keys=True, default=str)


def overlapping(tasks: list[dict], excluded: list[dict]) -> list[dict]:
    """Tasks whose id or content occurs among the excluded rows."""
    ids = {row.get("task_id") for row in excluded} - {None}
    contents = {content(row) for row in excluded}
    return [t for t in tasks if t.get("task_id") in ids or content(t) in contents]


def scores(env: TextEnv, tasks: list[dict], demos: list[list[list[dict]]]) -> list[float]:
    """The environment's reward of each single-turn demonstration (one batched call)."""
    completions = [[demo[i][1]["content"] for demo in demos] for i in range(env.num_agents)]
    out = env.reward(completions, tasks)
    rewards = out["reward"] if isinstance(out, dict) else out
    return [sum(r) / len(r) if isinstance(r, (list, tuple)) else float(r) for r in rewards]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help="registered environment name, or module:Class")
    parser.add_argument("--env-kwargs", type=json.loads, default={}, help="JSON object: the environment's arguments")
    parser.add_argument("--tasks", required=True, help="task rows to demonstrate (a file or a source the env knows)")
    parser.add_argument("--exclude", nargs="*", default=[], help="task files of RL and evaluation: must not overlap")
    parser.add_argument("--drop-overlap", action="store_true", help="leave overlapping tasks out instead of failing")
    parser.add_argument("--min-reward", type=float, default=1.0, help="text envs: keep demos scoring this")
    parser.add_argument("--limit", type=int, default=None, help="at most this many demonstrations")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        env = build_env(args.env, args.env_kwargs)
        tasks = task_rows(env, args.tasks, "--tasks")
        excluded = [row for path in args.exclude for row in task_rows(env, path, "--exclude")]
    except ConfigError as err:
        sys.exit(f"make_demos: {err}")
    clash = overlapping(tasks, excluded)
    if clash and not args.drop_overlap:
        names = ", ".join(str(t.get("task_id", content(t))) for t in clash[:5])
        sys.exit(
            f"make_demos: {len(clash)} demonstration task(s) also occur in --exclude ({names}...): demonstrations "
            "must come from tasks disjoint from RL and evaluation; pick other tasks or pass --drop-overlap"
        )
    clashing = {id(t) for t in clash}
    tasks = [t for t in tasks if id(t) not in clashing]

    kept, rejected = [], Counter()
    for task in tasks:
        try:
            kept.append((task, env.demonstration(task)))
        except ValueError as err:
            rejected[str(err).split(":")[-1].strip()[:80]] += 1
    if isinstance(env, TextEnv) and kept:
        if any(len(chat) != 2 for _, demo in kept for chat in demo):
            sys.exit("make_demos: multi-turn demonstrations of a text environment cannot be scored here yet")
        rewards = scores(env, [t for t, _ in kept], [d for _, d in kept])
        low = sum(r < args.min_reward for r in rewards)
        if low:
            rejected[f"reward below {args.min_reward}"] += low
        kept = [pair for pair, r in zip(kept, rewards) if r >= args.min_reward]
    kept = kept[: args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for task, demo in kept:
            f.write(json.dumps({"task_id": task.get("task_id"), "env": args.env, "messages": demo}) + "\n")
    turns = Counter(len(demo[0]) // 2 for _, demo in kept)
    print(
        f"{len(kept)} demonstrations -> {out} ({len(tasks)} tasks, {len(clash)} overlapping left out, "
        f"{sum(rejected.values())} rejected); turns per demonstration: {dict(sorted(turns.items()))}"
    )
    for reason, count in rejected.most_common(5):
        print(f"  rejected {count}: {reason}")


if __name__ == "__main__":
    main()
