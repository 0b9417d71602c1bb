"""Benchmark: the generation engines side by side on one model, the rollout's call shape.

Each engine generates ``--num-samples`` samples for each of ``--prompts`` chat prompts (one
``Engine.generate`` call, as a tree turn makes per agent), ``--max-new-tokens`` tokens at
temperature 1; the first call is a warm-up, then ``--repeats`` calls are timed. Printed per engine
and batch: median seconds per call, generated tokens per second, and whether greedy decoding
matches transformers' ``generate`` token for token, and for engines that return their samples'
log-probs the mean and largest |delta log p| against the trainer's forward on the same tokens.
``--context-tokens C`` gives every prompt a C-token history and each timed call extends the
previous call's prompts, as a multi-turn episode's next turn does (vLLM's prefix cache and the lean
engine's kept KV cache then hold the history; ``torch-reread`` is the lean engine keeping nothing,
``data.engine_options: {kept_kv_gib: 0}``). The engines' timed calls alternate, each engine inside
its rollout block (where it keeps caches) for the whole run. ``--bf16`` runs everything under bf16
autocast, as ``trainer.precision: bf16-mixed`` rollouts do. The last line is one JSON object.

    .venv/bin/python scripts/bench_engines.py                                  # tiny Qwen2, auto/torch/hf
    .venv/bin/python scripts/bench_engines.py --engine torch torch-reread --context-tokens 600 --num-samples 1 \
        --max-new-tokens 32 --prompts 8 --model ~/.cache/lit_marl/smollm2-135m-instruct   # the multi-turn shape
    .venv/bin/python scripts/bench_engines.py --model ~/.cache/lit_marl/smollm2-135m-instruct --repeats 2
    .venv-vllm/bin/python scripts/bench_engines.py --engine torch vllm --model ~/.cache/lit_marl/smollm2-135m-instruct
    python scripts/bench_engines.py --engine hf vllm --device cuda --model PATH  # on a GPU machine with vLLM
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_workload as workload  # noqa: E402
import torch  # noqa: E402

from lit_marl.generation import Sampling  # noqa: E402

ENGINES = ["auto", "torch", "torch-reread", "hf", "vllm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the benchmark's tiny Qwen2)")
    parser.add_argument("--engine", nargs="+", default=["torch", "hf"], choices=ENGINES)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 4, 16], help="prompts per call (a grid)")
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3, help="GPU only")
    parser.add_argument("--context-tokens", type=int, default=0, help="a multi-turn-shaped history per prompt")
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from lit_marl.agents import Agent
    from lit_marl.generation import make_engine

    model = args.model or str(workload.default_model_folder())
    agent = Agent(model)
    agent.model.to(args.device).eval()
    gpu = args.device.startswith("cuda")
    options = {"gpu_memory_utilization": args.vllm_gpu_memory_utilization} if gpu else {}
    engines = {}
    blocks = contextlib.ExitStack()
    for name in args.engine:
        start = time.perf_counter()
        if name == "torch-reread":
            engines[name] = make_engine("torch", {"kept_kv_gib": 0})
        else:
            engines[name] = make_engine(name, options if name == "vllm" else {})
        blocks.enter_context(engines[name].rollout([agent]))
        with autocast(args):
            engines[name].generate(
                agent, [agent.encode_prompt("hi")], 1, sampling=Sampling(max_new_tokens=2)
            )  # vLLM starts here
        print(f"{name:>12} | started in {time.perf_counter() - start:.1f} s", flush=True)
    reference = make_engine("hf")
    results = []
    with blocks:
        for count in args.prompts:
            results += measure(agent, engines, reference, count, args, gpu)
    print(
        json.dumps(
            {
                "model": model,
                "device": args.device,
                "threads": args.threads,
                "bf16": args.bf16,
                "context_tokens": args.context_tokens,
                "results": results,
            }
        )
    )


def measure(agent, engines, reference, count, args, gpu) -> list[dict]:
    """One batch shape: each engine's greedy check and warm-up, then the timed calls, alternating."""
    tasks = workload.tasks(count)
    prompts = [history(agent, i, args.context_tokens) + agent.encode_prompt(t["prompt"]) for i, t in enumerate(tasks)]
    expected = reference.generate(
        agent, prompts, 1, sampling=Sampling(max_new_tokens=args.max_new_tokens, greedy=True)
    ).completion_ids.cpu()
    same, times, tokens, last = {}, {}, {}, {}
    for name, engine in engines.items():
        with autocast(args):
            greedy = engine.generate(
                agent, prompts, 1, sampling=Sampling(max_new_tokens=args.max_new_tokens, greedy=True)
            ).completion_ids.cpu()
        same[name] = greedy.shape == expected.shape and torch.equal(greedy, expected)
        torch.manual_seed(0)
        with autocast(args):
            engine.generate(
                agent, prompts, args.num_samples, sampling=Sampling(max_new_tokens=args.max_new_tokens)
            )  # warm-up
        times[name], tokens[name] = [], []
    call_prompts = prompts
    for r in range(args.repeats):
        if args.context_tokens:  # the next turn: the previous prompts, extended
            call_prompts = [p + agent.tokenizer(f" Turn {r}: go on.")["input_ids"] for p in call_prompts]
        for name, engine in engines.items():
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with autocast(args):
                last[name] = engine.generate(
                    agent, call_prompts, args.num_samples, sampling=Sampling(max_new_tokens=args.max_new_tokens)
                )
            if gpu:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            tokens[name].append(last[name].num_generated_tokens)
    rows = []
    for name in engines:
        mean_diff, max_diff = mismatch(agent, last[name], args)
        median = statistics.median(times[name])
        row = {
            "engine": name,
            "prompts": count,
            "sequences": count * args.num_samples,
            "median_s": median,
            "min_s": min(times[name]),
            "tokens_per_call": statistics.fmean(tokens[name]),
            "tokens_per_s": statistics.fmean(tokens[name]) / median,
            "greedy_equals_generate": same[name],
            "logp_diff_mean": mean_diff,
            "logp_diff_max": max_diff,
        }
        rows.append(row)
        print(
            f"{name:>12} | {row['sequences']:4d} sequences: {median:.3f} s/call (min {row['min_s']:.3f}), "
            f"{row['tokens_per_call']:.0f} tokens, {row['tokens_per_s']:.0f} tok/s, greedy == generate: {same[name]}, "
            f"|d log p| vs trainer: mean {mean_diff:.2e} max {max_diff:.2e}",
            flush=True,
        )
    return rows


def autocast(args):
    return torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16)


def history(agent, index: int, tokens: int) -> list[int]:
    """A ``tokens``-long history, its own per prompt (a multi-turn episode's earlier turns)."""
    if not tokens:
        return []
    words = " ".join(f"step {index}.{k}: looked, moved, took the key." for k in range(tokens))
    return agent.tokenizer(words)["input_ids"][:tokens]


def mismatch(agent, gen, args) -> tuple[float, float]:
    """Mean and largest |log p| difference between the engine's log-probs of its samples and the
    trainer's forward (in the same precision) on those tokens; nan where the engine gives none."""
    from lit_marl.logprobs import completion_logprobs

    if gen.logprobs is None:
        return float("nan"), float("nan")
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    with torch.no_grad(), autocast(args):
        trainer = completion_logprobs(agent.model, ids, mask, gen.completion_ids.shape[1])
    diff = (trainer - gen.logprobs).abs()[gen.completion_mask.bool()]
    return float(diff.mean()), float(diff.max())


if __name__ == "__main__":
    main()
