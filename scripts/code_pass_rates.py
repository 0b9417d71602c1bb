"""Pass rates of a model on coding problems through the code environment's sandboxed reward.

Prints, per problem family, the greedy pass rate and the sampled pass rate (``--samples`` per
problem at ``--temperature``), then one JSON line with the totals. Used to check that the bundled
easy set has a real spread for SmolLM2-135M-Instruct (neither all solved nor all failed).

    python scripts/code_pass_rates.py --model smollm2-135m-instruct --samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

from lit_marl.generation import Sampling

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--problems", nargs="+", default=["data/code/easy_train.jsonl", "data/code/easy_heldout.jsonl"])
    parser.add_argument("--roles", default="single")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=32, help="prompts per generate call")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from lit_marl.agents import Agent
    from lit_marl.envs.code import CodeEnv, load_problems
    from lit_marl.generation import generate

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = CodeEnv(roles=args.roles)
    problems = [p for source in args.problems for p in load_problems(source)]
    agent = Agent(args.model)
    agent.model.requires_grad_(False)

    def solve(greedy: bool, samples: int) -> list[list[float]]:
        """passed-test fractions [problem][sample]; every role is played by the same model."""
        prompts = [[agent.encode_prompt(p) for p in env.prompts(task)] for task in problems]
        texts = [[[] for _ in env.roles] for _ in problems]  # [problem][role][sample]
        for role in range(env.num_agents):
            for start in range(0, len(problems), args.batch):
                chunk = [prompts[i][role] for i in range(start, min(start + args.batch, len(problems)))]
                with torch.no_grad():
                    out = generate(
                        agent,
                        chunk,
                        samples,
                        sampling=Sampling(
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, greedy=greedy
                        ),
                    )
                decoded = agent.decode(out.completion_ids, out.completion_mask)
                for k in range(len(chunk)):
                    texts[start + k][role] = decoded[k * samples : (k + 1) * samples]
        completions = [
            [texts[i][r][s] for i in range(len(problems)) for s in range(samples)] for r in range(len(env.roles))
        ]
        tasks = [task for task in problems for _ in range(samples)]
        passed = env.reward(completions, tasks)["level/tests_passed"]
        return [passed[i * samples : (i + 1) * samples] for i in range(len(problems))]

    start = time.perf_counter()
    greedy = solve(True, 1)
    sampled = solve(False, args.samples)
    seconds = time.perf_counter() - start
    families: dict[str, list[int]] = defaultdict(list)
    for i, task in enumerate(problems):
        families[task.get("family", task["task_id"].split("/")[0])].append(i)
    print(f"{'family':<16} {'problems':>8} {'greedy solved':>14} {'sampled solved':>15} {'tests passed':>13}")
    for family, index in families.items():
        g = sum(greedy[i][0] == 1.0 for i in index) / len(index)
        s = sum(x == 1.0 for i in index for x in sampled[i]) / (len(index) * args.samples)
        t = sum(x for i in index for x in sampled[i]) / (len(index) * args.samples)
        print(f"{family:<16} {len(index):>8} {g:>14.2f} {s:>15.2f} {t:>13.2f}")
    per_problem = [sum(x == 1.0 for x in sampled[i]) / args.samples for i in range(len(problems))]
    summary = {
        "model": args.model,
        "problems": len(problems),
        "samples": args.samples,
        "greedy_solved": sum(g[0] == 1.0 for g in greedy) / len(problems),
        "sampled_solved": sum(per_problem) / len(problems),
        "problems_never_solved": sum(p == 0 for p in per_problem),
        "problems_always_solved": sum(p == 1 for p in per_problem),
        "problems_mixed": sum(0 < p < 1 for p in per_problem),
        "seconds": round(seconds, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
