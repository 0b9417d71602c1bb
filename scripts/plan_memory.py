"""The memory plan of a config at a size this machine cannot load: the config's modules are built
with the real architecture on PyTorch's meta device (shapes and dtypes, no weights; the tokenizer
is the tiny model's), and ``lit_marl.memory.plan`` counts them as ``lit-marl fit`` would on the
GPUs: weights sharded over the ranks (FSDP2), the activation profile measured on small CPU copies
of the architecture, vLLM's share of the device. Prints the plan per rank for each layout.

    .venv/bin/python scripts/plan_memory.py configs/scale/textworld_grpo_qwen1.5b.yaml --ranks 8 16
    .venv/bin/python scripts/plan_memory.py configs/scale/textworld_grpo_qwen7b.yaml --mode per_layer --summary

The model is the config's own (``model.init_args.model``, the last config that sets it), unless
``--model`` plans another. Every phase is planned (setup, rollout, evaluation, update) with a GPU's
margins (CUDA context, NCCL buffers, the allocator's fragmentation, a sleeping vLLM's remainder).
The configs in configs/scale/ carry these figures in their headers (H100: 79.65 GiB as it reports).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def qwen2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool, vocab=152064, eps=1e-6):
    """A Qwen2.5 config.json's fields (what the plan reads: the shapes)."""
    return dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=32768,
        rms_norm_eps=eps,
        rope_theta=1000000.0,
        tie_word_embeddings=tied,
    )


# the architectures of the guide's models (their config.json, as published)
ARCHITECTURES = {
    "Qwen/Qwen2.5-1.5B-Instruct": qwen2(1536, 8960, 28, 12, 2, tied=True, vocab=151936),
    "Qwen/Qwen2.5-7B-Instruct": qwen2(3584, 18944, 28, 28, 4, tied=False),
    "Qwen/Qwen2.5-14B-Instruct": qwen2(5120, 13824, 48, 40, 8, tied=False, eps=1e-5),
    "Qwen/Qwen2.5-32B-Instruct": qwen2(5120, 27648, 64, 40, 8, tied=False, eps=1e-5),
}


def meta_loader(folder: Path):
    """``load_model_and_tokenizer`` for ``folder``: the architecture on the meta device, the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_marl.models import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer("tiny-random")

    def load(source: str):
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.eval(), tokenizer

    return load


def init_args(configs: list[str], *section: str) -> dict:
    """The ``init_args`` of one section of ``configs`` (``data``; ``trainer``, ``strategy``), merged as
    the CLI merges them: a later config's key wins."""
    import yaml

    merged: dict = {}
    for path in configs:
        node = yaml.safe_load(Path(path).read_text()) or {}
        for key in section:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            merged.update(node.get("init_args") or {})
    return merged


def stand_in_args(configs: list[str], model: str) -> list[str]:
    """CLI arguments that build a GPU config's modules on this CPU: one process, no logger or
    callbacks, ``model`` for every agent, the torch decoder for vLLM (not installed here)."""
    args = [arg for path in configs for arg in ("--config", str(path))]
    args += ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto"]
    args += ["--trainer.logger=false", "--trainer.callbacks=[]", f"--model.init_args.model={model}"]
    args += ["--data.init_args.engine=torch", "--data.init_args.engine_options=null"]
    data = init_args(configs, "data")
    for key in ("train_path", "val_path"):  # named game sets: 2 games each (the plan needs the shapes)
        value = str(data.get(key) or "")
        if value.startswith("alfworld-data:"):  # the official games: generated ones of the same shape
            args.append(f"--data.init_args.{key}=alfworld:{'train' if key == 'train_path' else 'test'}:1")
        elif ":" in value and value.rsplit(":", 1)[1].isdigit():
            args.append(f"--data.init_args.{key}={value.rsplit(':', 1)[0]}:2")
    return args


def plan_config(
    configs: list[str],
    model: str,
    ranks: int,
    capacity_gib: float,
    process_gib: float,
    extra: list[str],
    mode: str,
    vllm: dict | None = None,
):
    """The plan of ``configs`` with ``model``'s architecture over ``ranks`` GPUs in FSDP2 ``mode``;
    vLLM (where the config generates with it) with the options it would run with on a GPU (its
    ``gpu_memory_utilization``, sleep mode), and a note where it needs more than its share."""
    from lit_marl.cli import build_cli
    from lit_marl.generation.vllm import GPU_DEFAULTS
    from lit_marl.memory import GiB, plan

    init = init_args(configs, "data")  # the engine options as the GPU run would use them
    strategy = init_args(configs, "trainer", "strategy")  # TeamFSDPStrategy's (the stand-in is one process)
    gather_dtype = strategy.get("gather_dtype", "float32") if mode == "per_layer" else "float32"
    options = {**GPU_DEFAULTS, **(init.get("engine_options") or {}), **(vllm or {})}
    if "gpu_memory_utilization" in (vllm or {}):
        options.pop("kv_cache_memory_bytes", None)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(ARCHITECTURES[model]))
        load = meta_loader(folder)
        args = stand_in_args(configs, str(folder)) + extra
        with mock.patch("lit_marl.agents.load_model_and_tokenizer", load):
            with mock.patch("lit_marl.algorithms.critics.load_model_and_tokenizer", load):
                cli = build_cli(args=args, run=False)
                cli.model.configure_model()
        data = cli.datamodule
        if init.get("engine") == "vllm":  # the stand-in decoder generates here; plan the GPU's vLLM
            from lit_marl.generation.vllm import VLLMEngine

            data.engine = VLLMEngine(backend_factory=lambda agent, dtype: None)
        elif init.get("engine") == "vllm_server":  # generation on the servers' GPUs: nothing started here
            from lit_marl.generation import make_engine

            data.engine = make_engine("vllm_server", init.get("engine_options"))
        return plan(
            cli.model,
            data.rollout_settings,
            shard_over=ranks,
            vllm_share=options["gpu_memory_utilization"] if init.get("engine") == "vllm" else None,
            process=process_gib * GiB,
            capacity=capacity_gib * GiB,
            autocast=cli.trainer.precision.startswith("bf16"),
            mode=mode,
            vllm_options=options,
            gpu=True,
            gather_dtype=gather_dtype,
        )


def config_model(configs: list[str]) -> str:
    """The model a config trains (the last of ``configs`` that names one)."""
    named = init_args(configs, "model").get("model")
    if named not in ARCHITECTURES:
        raise SystemExit(
            f"{configs}: model {named!r} has no architecture here; give --model, one of {sorted(ARCHITECTURES)}"
        )
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", help="a config, then overlays")
    parser.add_argument("--model", choices=sorted(ARCHITECTURES), help="plan another model (default: the config's)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="FSDP ranks (8: one node, 16: two)")
    parser.add_argument("--mode", nargs="+", default=["gathered", "per_layer"], choices=["gathered", "per_layer"])
    parser.add_argument("--capacity-gib", type=float, default=79.65, help="memory per GPU (an H100 reports 79.65)")
    parser.add_argument("--process-gib", type=float, default=0.5, help="runtime and data per rank (beside the context)")
    parser.add_argument("--set", action="append", default=[], help="a further override --KEY=VALUE")
    parser.add_argument("--summary", action="store_true", help="one line per layout: update / rollout / peak")
    parser.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share (default: the config's)")
    parser.add_argument(
        "--vllm-tp", type=int, help="plan colocated vLLM with this tensor_parallel_size (a what-if: it has none)"
    )
    args = parser.parse_args()
    from lit_marl.memory import PHASES

    args.model = args.model or config_model(args.configs)
    for mode in args.mode:
        for ranks in args.ranks:
            vllm = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.gpu_memory_utilization else {}
            vllm |= {"tensor_parallel_size": args.vllm_tp} if args.vllm_tp else {}
            result = plan_config(
                args.configs, args.model, ranks, args.capacity_gib, args.process_gib, args.set, mode, vllm
            )
            result.device = f"{args.model}, {ranks} ranks of {args.capacity_gib:g} GiB"
            if args.vllm_tp:
                result.notes.append(
                    f"colocated vLLM at tensor_parallel_size {args.vllm_tp}: a what-if (engine vllm_server serves TP)"
                )
            if args.summary:
                phases = "  ".join(f"{p} {result.phase(p) / 2**30:5.1f}" for p in PHASES)
                print(
                    f"{args.model} {mode:<9} {ranks:>3} ranks: {phases}  peak {result.peak / 2**30:5.1f} GiB "
                    f"({result.fullest}){'  SHORT: ' + '; '.join(result.short) if result.short else ''}",
                    flush=True,
                )
            else:
                print(result.table(), flush=True)


if __name__ == "__main__":
    main()
