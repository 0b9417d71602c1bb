"""Rollout time of episodes that play their own turns (``data.turns: independent``) against lockstep turns
(``lockstep``: turn t of every episode together), on a vLLM server, with a game whose turns take uneven
times (a tool call's latency, drawn per task and turn from an exponential distribution).

    make vllm
    .venv-vllm/bin/python scripts/bench_turns.py --episodes 8 --max-turns 4 --repeats 3 --mean-sleep 0.5

One server (started by the engine), greedy episodes on Corridor's first tasks (in lockstep a turn's games
step in parallel, a thread each, as the data module's ``env_workers`` do), the two settings alternating
within each repeat. Both play the same episodes (greedy; checked) with the same sleeps, so the difference is
the waiting: lockstep's floor is the sum over turns of the slowest episode's sleep, independent turns' the
largest sum of one episode's sleeps. Prints one JSON line per rollout and a summary line with the medians,
both floors and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean-sleep", type=float, default=0.5, help="mean seconds a game turn waits")
    args = parser.parse_args()

    import torch

    from lit_marl.agents import Agent
    from lit_marl.envs.corridor import Corridor
    from lit_marl.generation import Sampling, make_engine
    from lit_marl.rollout.episode import EpisodeSettings, run_episodes

    sleeps: dict[tuple[str, int], float] = {}

    class UnevenCorridor(Corridor):
        """Corridor whose turn t of task k waits a time drawn once for (k, t), the same in every rollout."""

        def start(self, task):
            self.key, self.turn = task["task_id"], 0
            return super().start(task)

        def play(self, actions):
            wait = sleeps.setdefault(
                (self.key, self.turn), random.Random(f"{self.key}/{self.turn}").expovariate(1 / args.mean_sleep)
            )
            self.turn += 1
            time.sleep(wait)
            return super().play(actions)

    rows = (REPO / "data" / "corridor" / "train.jsonl").read_text().splitlines()[: args.episodes]
    tasks = [json.loads(row) for row in rows]
    agent = Agent(args.model)
    engine = make_engine("vllm_server", {"server_args": {"max_model_len": 2048, "max_num_seqs": 64}})
    sampling = Sampling(max_new_tokens=args.max_new_tokens, greedy=True)
    times: dict[str, list[float]] = {"lockstep": [], "independent": []}
    played = {}
    try:
        with engine.rollout([agent]):  # the server started and the weights sent, outside the timings
            engine.generate(agent, [agent.encode_prompt("Hello")], 1, sampling)
        for repeat in range(args.repeats):
            for turns in ("lockstep", "independent"):
                settings = EpisodeSettings(group_size=1, max_turns=args.max_turns, sampling=sampling, turns=turns)
                started = time.perf_counter()
                env = UnevenCorridor()
                env.pool = ThreadPoolExecutor(args.episodes)  # lockstep's games step in parallel (the data module's)
                with engine.rollout([agent]):
                    (batch,) = run_episodes([agent], tasks, env, settings, engine)
                seconds = time.perf_counter() - started
                times[turns].append(seconds)
                played[turns] = batch
                print(
                    json.dumps(
                        {
                            "turns": turns,
                            "repeat": repeat,
                            "rollout_s": round(seconds, 2),
                            "turns_played": int(batch.num_turns.sum()),
                            "generated_tokens": batch.stats["perf/generated_tokens"],
                        }
                    ),
                    flush=True,
                )
    finally:
        engine.close()
    same = torch.equal(played["lockstep"].input_ids, played["independent"].input_ids)
    lengths = played["lockstep"].num_turns.tolist()
    per_episode = [[sleeps[task["task_id"], t] for t in range(n)] for task, n in zip(tasks, lengths)]
    lockstep_floor = sum(max((s[t] for s in per_episode if t < len(s)), default=0.0) for t in range(max(lengths)))
    independent_floor = max(sum(s) for s in per_episode)
    lock, own = statistics.median(times["lockstep"]), statistics.median(times["independent"])
    print(
        f"median rollout s: lockstep {lock:.2f}, independent {own:.2f} ({lock / own:.2f}x); sleep floors: "
        f"lockstep {lockstep_floor:.2f}, independent {independent_floor:.2f}; same episodes: {same} "
        f"({args.episodes} episodes, up to {args.max_turns} turns, mean sleep {args.mean_sleep} s, "
        f"{args.repeats} repeats)",
        flush=True,
    )


if __name__ == "__main__":
    main()
