"""The prepared GPU check (a few minutes on one GPU): bf16 SmolLM2-135M-Instruct

1. generation: the lean torch decoder and, where vLLM is installed, the vLLM engine; ``--rows``
   sequences of ``--new-tokens`` tokens under bf16 autocast; tokens/s and the fraction of the HBM
   roofline (each decode step must read the weights once and the KV cache so far: the bound is
   rows x bandwidth / bytes read per step);
2. one PPO step (the corridor env, a separate critic model, bf16-mixed, activation checkpointing):
   its seconds, ``torch.cuda.max_memory_allocated`` and the memory plan's peak for it.

Prints one line per figure and a last JSON line; docs/benchmark.md records them.

    python scripts/gpu_check.py --out $OUT            # on the GPU machine (HF_HUB_OFFLINE=1)
    .venv/bin/python scripts/gpu_check.py --device cpu --model tiny-random --rows 8 --new-tokens 16 \\
        --ppo-tasks 2 --ppo-turns 2  # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lit_marl.generation import Sampling  # noqa: E402

# HBM bandwidth by device name (bytes/s, the vendor's figure)
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12}


def bandwidth(name: str) -> float | None:
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode(engine_name: str, agent, rows: int, new_tokens: int, device: str) -> dict:
    from lit_marl.generation import make_engine

    engine = make_engine(engine_name, {"gpu_memory_utilization": 0.3} if engine_name == "vllm" else {})
    prompt = agent.encode_prompt("Describe a kitchen in one long paragraph.")
    with torch.autocast(device, dtype=torch.bfloat16):
        engine.generate(agent, [prompt], 2, sampling=Sampling(max_new_tokens=8))  # warm-up (and vLLM's weight load)
        sync(device)
        start = time.perf_counter()
        out = engine.generate(
            agent, [prompt] * (rows // 4), 4, sampling=Sampling(max_new_tokens=new_tokens, temperature=1.0)
        )
        sync(device)
        seconds = time.perf_counter() - start
    generated = int(out.completion_mask.sum())
    from lit_marl.memory import kv_cache_bytes

    weights = sum(p.numel() for p in agent.model.parameters()) * 2  # bf16
    kv_per_token = kv_cache_bytes(agent.model, rows=1, tokens=1, dtype=torch.bfloat16)
    context = len(prompt) + new_tokens / 2  # mean KV length over the decode
    per_step = weights + rows * context * kv_per_token
    bw = bandwidth(torch.cuda.get_device_name()) if device == "cuda" else None
    roofline = rows * bw / per_step if bw else None
    tokens_s = generated / seconds
    return {
        "engine": engine_name,
        "rows": rows,
        "tokens": generated,
        "s": seconds,
        "tokens_per_s": tokens_s,
        "roofline_tokens_per_s": roofline,
        "roofline_fraction": tokens_s / roofline if roofline else None,
    }


def ppo_step(out: Path, model: str, device: str, tasks: int = 16, turns: int = 6) -> dict:
    import lightning as L

    from lit_marl.algorithms import PPO
    from lit_marl.data import EpisodeDataModule
    from lit_marl.memory import plan

    L.seed_everything(0)
    module = PPO(
        model=model,
        critic={"kind": "model"},
        memory={"activation_checkpointing": True, "forward_token_budget": 4096, "weights_dtype": "bfloat16"},
        kl={"coef": 0.01},
    )
    data = EpisodeDataModule(
        env="corridor",
        train_path=str(ROOT / "data/corridor/train.jsonl"),
        tasks_per_step=tasks,
        num_generations=1,
        max_turns=turns,
        sampling={"max_new_tokens": 16},
    )
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
    )
    planned = {}
    original = module.on_fit_start

    def record_plan():
        original()
        planned["peak"] = plan(module, data.rollout_settings).peak

    module.on_fit_start = record_plan
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    sync(device)
    return {
        "ppo_step_s": time.perf_counter() - start,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "planned_peak_gib": planned.get("peak", 0.0) / 2**30,
        "global_step": trainer.global_step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default="/tmp/lit_marl_gpu_check")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ppo-tasks", type=int, default=16, help="episodes of the PPO step")
    parser.add_argument("--ppo-turns", type=int, default=6, help="turns per episode of the PPO step")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU (--device cpu runs it as a smoke test)")
    from lit_marl.agents import Agent

    agent = Agent(args.model)
    agent.model.to(args.device).eval()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"device": name, "torch": torch.__version__}
    engines = ["torch"]
    try:
        import vllm  # noqa: F401

        engines.append("vllm")
    except ImportError:
        print("vllm is not installed: the lean decoder only", flush=True)
    for engine in engines:
        result = decode(engine, agent, args.rows, args.new_tokens, args.device)
        results[f"decode_{engine}"] = result
        print(json.dumps(result), flush=True)
    del agent
    if args.device == "cuda":
        torch.cuda.empty_cache()
    results["ppo"] = ppo_step(Path(args.out), args.model, args.device, args.ppo_tasks, args.ppo_turns)
    print(json.dumps(results["ppo"]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
