"""Benchmark: the generation engines side by side on one model, the rollout's call shape.

Each engine generates ``--num-samples`` samples for each of ``--prompts`` chat prompts (one
``Engine.generate`` call, as a tree turn makes per agent), ``--max-new-tokens`` tokens at
temperature 1; the first call is a warm-up, then ``--repeats`` calls are timed. Printed per engine
and batch: median seconds per call, generated tokens per second, and whether greedy decoding
matches transformers' ``generate`` token for token. The last line is one JSON object.

    .venv/bin/python scripts/bench_engines.py                                  # tiny Qwen2, auto/torch/hf
    .venv/bin/python scripts/bench_engines.py --model ~/.cache/lit_marl/smollm2-135m-instruct --repeats 2
    python scripts/bench_engines.py --engine hf vllm --device cuda --model PATH  # on a GPU machine with vLLM
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_workload as workload  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the benchmark's tiny Qwen2)")
    parser.add_argument("--engine", nargs="+", default=["torch", "hf"], choices=["auto", "torch", "hf", "vllm"])
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 4, 16], help="prompts per call (a grid)")
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lit_marl.agents import Agent
    from lit_marl.generation import make_engine

    model = args.model or str(workload.default_model_folder())
    agent = Agent(model)
    agent.model.to(args.device).eval()
    engines = {
        name: make_engine(name, {"gpu_memory_utilization": args.vllm_gpu_memory_utilization} if name == "vllm" else {})
        for name in args.engine
    }
    reference = make_engine("hf")
    results = []
    for count in args.prompts:
        prompts = [agent.encode_prompt(task["prompt"]) for task in workload.tasks(count)]
        expected = reference.generate(agent, prompts, 1, args.max_new_tokens, greedy=True).completion_ids.cpu()
        for name, engine in engines.items():
            greedy = engine.generate(agent, prompts, 1, args.max_new_tokens, greedy=True).completion_ids.cpu()
            same = greedy.shape == expected.shape and torch.equal(greedy, expected)
            torch.manual_seed(0)
            engine.generate(agent, prompts, args.num_samples, args.max_new_tokens)  # warm-up
            times, tokens = [], []
            for _ in range(args.repeats):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = engine.generate(agent, prompts, args.num_samples, args.max_new_tokens)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                tokens.append(out.num_generated_tokens)
            median = statistics.median(times)
            row = {
                "engine": name,
                "prompts": count,
                "sequences": count * args.num_samples,
                "median_s": median,
                "min_s": min(times),
                "tokens_per_call": statistics.fmean(tokens),
                "tokens_per_s": statistics.fmean(tokens) / median,
                "greedy_equals_generate": same,
            }
            results.append(row)
            print(
                f"{name:>5} | {row['sequences']:4d} sequences: {median:.3f} s/call (min {min(times):.3f}), "
                f"{row['tokens_per_call']:.0f} tokens, {row['tokens_per_s']:.0f} tok/s, greedy == generate: {same}",
                flush=True,
            )
    print(json.dumps({"model": model, "device": args.device, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
