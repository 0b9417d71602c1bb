"""The prepared GPU check of the memory plan (``lit_marl.memory``) at 7B width, in one process.

A random model of plan_memory.py's Qwen2.5-7B architecture with ``--layers`` decoder layers (default
4: the full width, few layers, fast) is built on the device; each figure of the plan that concerns it
is measured beside the plan's own figure for that very model. A ``torch.distributed`` world of 1
(NCCL on a GPU, gloo on CPU); nothing is downloaded. The plan's figures for the defaults (4 layers,
4096 tokens, fp32 weights: 7.53 GiB) are given with each check:

1. ``context``: what torch does not count (``mem_get_info`` used - ``memory_reserved``) after init
   and after NCCL's first collective; plan: ``CUDA_CONTEXT`` 0.6 + ``NCCL_BUFFERS`` 0.5 GiB.
2. ``per_layer_pass``: FSDP2 per layer, bf16 autocast, fp32 LM head, one forward+backward of
   ``--tokens`` tokens, every position scored (``masked_logprobs``), without and with activation
   checkpointing: the peak allocated above the resident shards vs the update's "gradients" + "layers
   gathered in a pass" (0 on one rank) + "activations of one update pass": 7.53 + 12.80 = 20.33 GiB
   plain, 7.53 + 8.73 = 16.26 checkpointed; ``*_any_world`` adds what a large world plans for the
   units gathered whole and their unsharded gradients (2.90 + 2.90 GiB: the embedding and a layer).
   The reserve at the peak (max reserved / max allocated - 1) vs ``FRAGMENTATION`` (10 %).
3. ``streamed_sync``: ``effective_weights(model, bf16)`` consumed tensor by tensor, as the vLLM sync
   under per-layer FSDP; plan: "weights in flight (vLLM sync)", 2 x the largest weight in bf16: 2.03 GiB.
4. ``padding_passes``: two zero-loss padding passes (``TeamShards.padding_pass`` with backward, over
   NCCL on a GPU): no error, every gradient exactly 0 or None.
5. ``setup``: ``fully_shard`` per layer, then ``load_from_rank0`` from a CPU state dict, for a model
   built on the meta device (the other ranks' path) and one built on the host (rank 0's); plan:
   "weights" (one rank: the whole model) + "a weight in flight (setup)" (the largest, fp32): 7.53 + 2.03.
6. ``vllm_cycle`` (vLLM and a GPU only): a sleeping ``VLLMEngine`` on a small random model (1.5B
   architecture, 2 layers), 3 cycles of rollout (wake, sync, greedy) -> sleep -> cache emptied; its
   tokens and log-probs vs the trainer's forward; what vLLM keeps asleep vs ``VLLM_ASLEEP`` (1.0 GiB).

One line and one JSON record (OUT/gpu_check_scale.jsonl) per check, then a JSON line of all records. A
check that cannot run here (an older torch's FSDP2, no vLLM) is skipped with its reason; one that fails
records its error and the next runs. On CPU the device figures are null.

    python scripts/gpu_check_scale.py --out $OUT                                       # on the GPU
    .venv/bin/python scripts/gpu_check_scale.py --device cpu --arch tiny --out /tmp/x  # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from plan_memory import ARCHITECTURES, qwen2  # noqa: E402

from lit_marl.generation import Sampling  # noqa: E402

GiB = 2**30
ARCHS = {name.split("-")[1].lower(): name for name in ARCHITECTURES}  # 1.5b, 7b, 14b, 32b
TINY = dict(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2, tied=False, vocab=512)
FSDP_METHODS = ("set_reduce_scatter_unused_params", "set_force_sum_reduction_for_comms", "set_gradient_divide_factor")


class Skipped(Exception):
    """A check that cannot run here; the message says why."""


def gib(size: float | None) -> float | None:
    return None if size is None else round(size / GiB, 3)


def ratio(measured: float | None, planned: float | None) -> float | None:
    return None if measured is None or not planned else round(measured / planned, 3)


def device_used() -> int:
    """Bytes in use on the GPU, every allocator's and the context's: ``mem_get_info``'s total - free."""
    free, total = torch.cuda.mem_get_info()
    return total - free


class Meter:
    """torch's allocated bytes above a start, now and at their peak (None on CPU: no allocator stats)."""

    def __init__(self, device: torch.device):
        self.cuda, self.before = device.type == "cuda", 0
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

    def now(self) -> int | None:
        return torch.cuda.memory_allocated() - self.before if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() - self.before if self.cuda else None

    def reserve(self) -> float | None:
        """The allocator's reserve at the peak: max reserved / max allocated - 1."""
        top = torch.cuda.max_memory_reserved() / max(torch.cuda.max_memory_allocated(), 1) if self.cuda else None
        return None if top is None else round(top - 1, 3)


def architecture(arch: str, layers: int | None):
    """The transformers config of ``arch`` (plan_memory's table, or the tiny Qwen2), ``layers`` deep."""
    from transformers import AutoConfig

    fields = qwen2(**TINY) if arch == "tiny" else dict(ARCHITECTURES[ARCHS[arch]])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(fields.pop("model_type"), **fields)  # keeps ``architectures``: vLLM's class


def build_model(config, device: torch.device, seed: int = 0):
    """A random causal LM of ``config``, initialized on ``device`` (fp32, sdpa, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def fsdp_missing(ctx) -> str | None:
    """Why FSDP2 as lit_marl uses it cannot run here, or None."""
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} lacks FSDP2's public API ({e})"
    absent = [name for name in FSDP_METHODS if not hasattr(FSDPModule, name)]
    if "broadcast_from_rank0" not in getattr(StateDictOptions, "__dataclass_fields__", {}):
        absent.append("StateDictOptions.broadcast_from_rank0")
    if absent:
        return f"torch {torch.__version__} lacks {', '.join(absent)}"
    return None if ctx.mesh is not None else f"no device mesh: {ctx.mesh_error}"


def sharded_model(ctx):
    """The check model sharded per layer (built once), and the plan's figures for it."""
    if ctx.model is not None:
        return ctx.model, ctx.shards
    if reason := fsdp_missing(ctx):
        raise Skipped(reason)
    from lit_marl.activations import activation_profile
    from lit_marl.memory import weight_parts
    from lit_marl.models import fp32_heads
    from lit_marl.parallel.fsdp import TeamShards, unit_modules

    model = build_model(ctx.config, ctx.device)
    fp32_heads(model)
    ctx.profile = activation_profile(model, torch.bfloat16)
    # planned before sharding: fully_shard renames the layers' class (FSDPQwen2DecoderLayer) and the
    # plan finds layers by class name (unit_modules: ``layer_units`` in the record shows it)
    ctx.parts = weight_parts(model, 1, "per_layer", [], gather_dtype=ctx.args.gather_dtype)[0]
    wide = weight_parts(model, 2**20, "per_layer", [], gather_dtype=ctx.args.gather_dtype)[0]
    ctx.whole_units = wide["layers gathered in a pass"] + wide["gradients"]  # the units whole, their gradients
    before = len(unit_modules(model)[0])
    ctx.shards = TeamShards([model], ctx.mesh, "per_layer", ctx.args.gather_dtype)
    ctx.layer_units = {"before_sharding": before, "after": len(unit_modules(model)[0])}
    ctx.model = model
    return model, ctx.shards


def free_model(ctx) -> None:
    ctx.model = ctx.shards = None
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def check_context(ctx) -> dict:
    from lit_marl.memory import CUDA_CONTEXT, NCCL_BUFFERS

    if ctx.device.type != "cuda":  # the process's peak resident memory so far (Linux: KiB)
        top = gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return {"device": "cpu", "max_rss_gib": top, "summary": f"cpu, peak RSS {top} GiB: no CUDA context"}
    torch.zeros(1, device=ctx.device)
    torch.cuda.synchronize()
    context = device_used() - torch.cuda.memory_reserved()
    torch.distributed.all_reduce(torch.ones(1, device=ctx.device))  # NCCL's communicator starts here
    torch.cuda.synchronize()
    outside = device_used() - torch.cuda.memory_reserved()
    props, planned = torch.cuda.get_device_properties(ctx.device), CUDA_CONTEXT + NCCL_BUFFERS
    record = {"device": props.name, "total_gib": gib(props.total_memory), "context_gib": gib(context)}
    record |= {"nccl_gib": gib(outside - context), "outside_gib": gib(outside), "planned_gib": gib(planned)}
    record["ratio"] = ratio(outside, planned)
    record["note"] = "one rank: NCCL has no peer channels, a multi-rank communicator's buffers are larger"
    record["summary"] = (
        f"{props.name}, {gib(props.total_memory)} GiB: context {gib(context)} + NCCL {gib(outside - context)} "
        f"GiB outside torch vs plan {gib(planned)} (x{record['ratio']})"
    )
    return record


def switch_checkpointing(model) -> str:
    """Activation checkpointing on, as lit_marl switches it (``checkpoint_layers``) where transformers can."""
    from lit_marl.models import checkpoint_layers

    if hasattr(model, "activation_checkpointing_enable"):
        checkpoint_layers(model)
        return "lit_marl.models.checkpoint_layers"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return "gradient_checkpointing_enable (this transformers has no activation_checkpointing_enable)"


def update_pass(ctx, checkpointing: bool) -> dict:
    """One update pass, as an algorithm's: bf16 autocast, in lockstep, the log-probs of every position."""
    from lit_marl.logprobs import masked_logprobs
    from lit_marl.models import checkpointed_passes

    model, shards, tokens = ctx.model, ctx.shards, ctx.tokens
    ids = torch.randint(0, ctx.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ctx.device)
    mask = torch.ones_like(ids)
    model.zero_grad(set_to_none=True)
    meter, start = Meter(ctx.device), time.perf_counter()
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16), checkpointed_passes(model):
        for _ in shards.lockstep([0], [model], backward=True):
            logprobs = masked_logprobs(model, ids, mask, mask)[0]
            (-logprobs.sum() / tokens).backward()
    measured, seconds = meter.peak(), round(time.perf_counter() - start, 2)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    finite = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
    del grads
    model.zero_grad(set_to_none=True)
    activations = ctx.profile.pass_bytes(tokens, tokens, checkpointing)
    planned = ctx.parts["gradients"] + ctx.parts["layers gathered in a pass"] + activations
    record = {"measured_gib": gib(measured), "planned_gib": gib(planned), "ratio": ratio(measured, planned)}
    record |= {"planned_any_world_gib": gib(planned + ctx.whole_units)}
    record |= {"ratio_any_world": ratio(measured, planned + ctx.whole_units), "reserve": meter.reserve()}
    return record | {"planned_activations_gib": gib(activations), "finite_gradients": finite, "seconds": seconds}


def check_per_layer_pass(ctx) -> dict:
    from lit_marl.memory import FRAGMENTATION

    model, _ = sharded_model(ctx)
    plain = update_pass(ctx, False)
    how = switch_checkpointing(model)
    checkpointed = update_pass(ctx, True)
    record = {"tokens": ctx.tokens, "layers": ctx.config.num_hidden_layers, "plain": plain}
    record |= {"checkpointed": checkpointed, "checkpointing": how, "planned_reserve": FRAGMENTATION}
    record |= {"planned_gradients_gib": gib(ctx.parts["gradients"]), "whole_units_gib": gib(ctx.whole_units)}
    record |= {"resident_gib": gib(ctx.parts["weights"]), "layer_units": ctx.layer_units}
    record["compared"] = (
        "peak allocated above the shards vs gradients + layers gathered in a pass + activations of one update "
        "pass; *_any_world: + the units whole and their gradients as a large world plans them (0 on one rank)"
    )
    record["summary"] = "; ".join(
        f"{name} {r['measured_gib']} vs {r['planned_gib']} GiB (x{r['ratio']}, any world x{r['ratio_any_world']}, "
        f"reserve {r['reserve']})"
        for name, r in (("plain", plain), ("checkpointed", checkpointed))
    )
    return record


def check_streamed_sync(ctx) -> dict:
    from lit_marl.generation.weights import effective_weights

    model, _ = sharded_model(ctx)
    model.zero_grad(set_to_none=True)
    largest = max(p.numel() for p in model.parameters())
    planned = 2.0 * largest * 2  # memory._vllm_parts: a tied weight made once and the current one, bf16
    meter, count, streamed = Meter(ctx.device), 0, 0
    with torch.no_grad():
        for _name, tensor in effective_weights(model, torch.bfloat16):  # consumed and dropped, as vLLM's reload
            count, streamed = count + 1, streamed + tensor.numel() * tensor.element_size()
            del tensor
    measured = meter.peak()
    record = {"tensors": count, "streamed_gib": gib(streamed), "largest_bf16_gib": gib(largest * 2)}
    record |= {"measured_gib": gib(measured), "planned_gib": gib(planned), "ratio": ratio(measured, planned)}
    record["compared"] = "peak allocated above the resident shards vs 'weights in flight (vLLM sync)'"
    record["summary"] = (
        f"{count} tensors, {gib(streamed)} GiB: peak {gib(measured)} vs {gib(planned)} GiB (x{record['ratio']})"
    )
    return record


def check_padding_passes(ctx) -> dict:
    from lit_marl.models import checkpointed_passes

    model, shards = sharded_model(ctx)
    model.zero_grad(set_to_none=True)
    own = list(shards.lockstep([], [model], backward=True))  # no chunk here, none on any rank: no pass
    meter = Meter(ctx.device)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16), checkpointed_passes(model):
        for _ in range(2):  # what lockstep runs on a rank with 0 chunks where another rank has 2
            shards.padding_pass(shards.roots_in([model]), backward=True)
    grads = [p.grad for p in model.parameters()]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
    nonzero, backend = sum(int(torch.count_nonzero(g)) for g in local), str(torch.distributed.get_backend())
    model.zero_grad(set_to_none=True)
    record = {"status": "ok" if nonzero == 0 and not own else "failed", "backend": backend}
    record |= {"lockstep_own_passes": len(own), "gradients": len(local), "none_gradients": len(grads) - len(local)}
    record |= {"nonzero_gradients": nonzero, "peak_gib": gib(meter.peak())}
    record["summary"] = (
        f"2 padding passes over {backend}: {len(local)} gradients with {nonzero} nonzero entries, "
        f"{len(grads) - len(local)} None"
    )
    return record


def sharded_load(ctx, model, state: dict, empty: bool) -> dict:
    """``fully_shard`` per layer and ``load_from_rank0``: device memory resident after it and at its peak."""
    from lit_marl.parallel.fsdp import TeamShards, load_from_rank0

    name = next(n for n in state if n.endswith("q_proj.weight"))
    expected = state[name].detach().clone()
    meter, start = Meter(ctx.device), time.perf_counter()
    TeamShards([model], ctx.mesh, "per_layer", ctx.args.gather_dtype)
    if empty:  # as load_from_rank0 does on the other ranks (rank 0 would move the meta tensors)
        model.to_empty(device=ctx.device)
    load_from_rank0(model, [model], [dict(state)], ctx.device)  # a copy: set_model_state_dict updates it
    resident, peak, seconds = meter.now(), meter.peak(), round(time.perf_counter() - start, 2)
    loaded = dict(model.named_parameters())[name]
    loaded = loaded.full_tensor() if hasattr(loaded, "full_tensor") else loaded
    exact = bool(torch.equal(loaded.detach().cpu(), expected))
    record = {"resident_gib": gib(resident), "peak_gib": gib(peak), "loaded_exactly": exact, "seconds": seconds}
    return record | {"in_flight_gib": gib(None if peak is None else peak - resident)}


def check_setup(ctx) -> dict:
    if reason := fsdp_missing(ctx):
        raise Skipped(reason)
    from transformers import AutoModelForCausalLM

    free_model(ctx)
    host = build_model(ctx.config, torch.device("cpu"))  # rank 0's loaded weights, on the host
    state = host.state_dict()
    sizes = [p.numel() * p.element_size() for p in host.parameters()]
    resident, in_flight = float(sum(sizes)), float(max(sizes))
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(ctx.config, dtype=torch.float32, attn_implementation="sdpa")
    paths = {"meta": sharded_load(ctx, empty, state, True)}
    del empty
    paths["host"] = sharded_load(ctx, host, state, False)
    del host, state
    free_model(ctx)
    for r in paths.values():
        r["ratio"] = ratio(None if r["peak_gib"] is None else r["peak_gib"] * GiB, resident + in_flight)
    record = {**paths, "planned_resident_gib": gib(resident), "planned_in_flight_gib": gib(in_flight)}
    record["compared"] = "peak allocated while sharding and loading vs weights + a weight in flight (setup)"
    record["summary"] = "; ".join(
        f"{k}: peak {r['peak_gib']} (resident {r['resident_gib']} + {r['in_flight_gib']}) vs {gib(resident)} + "
        f"{gib(in_flight)} GiB (x{r['ratio']}), exact {r['loaded_exactly']}"
        for k, r in paths.items()
    )
    return record


def vllm_round(engine, agent, prompts: list[list[int]], base: int) -> dict:
    """Rollout (wake, sync, greedy generation) -> sleep -> cache emptied; then the trainer's forward."""
    from lit_marl.logprobs import completion_logits, token_logprobs

    with torch.autocast("cuda", dtype=torch.bfloat16):
        with engine.rollout([agent]):
            gen = engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=16, greedy=True))
            awake = device_used() - base
        gc.collect()
        torch.cuda.empty_cache()
        asleep = device_used() - base
        ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
        mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
        with torch.no_grad():
            logits = completion_logits(agent.model, ids, mask, gen.completion_ids.shape[1])
    keep, diff = gen.completion_mask.bool(), None
    if gen.logprobs is not None:
        diff = float((token_logprobs(logits, gen.completion_ids) - gen.logprobs).abs()[keep].max())
    agree = float((logits.argmax(-1) == gen.completion_ids)[keep].float().mean())
    record = {"tokens": int(keep.sum()), "max_logprob_diff": diff, "token_agreement": round(agree, 4)}
    return record | {"awake_gib": gib(awake), "asleep_gib": gib(asleep), "syncs": engine.syncs}


def check_vllm_cycle(ctx) -> dict:
    if importlib.util.find_spec("vllm") is None:
        raise Skipped("vllm is not installed")
    if ctx.device.type != "cuda":
        raise Skipped("vLLM's sleep mode needs a GPU")
    from lit_marl.agents import Agent
    from lit_marl.generation.vllm import VLLMEngine
    from lit_marl.memory import VLLM_ASLEEP
    from lit_marl.models import fp32_heads

    free_model(ctx)
    config = architecture(ctx.args.vllm_arch, ctx.args.vllm_layers)
    model = build_model(config, ctx.device, seed=1)
    fp32_heads(model)
    tokenizer = SimpleNamespace(eos_token_id=config.vocab_size - 1, pad_token_id=0)  # vLLM takes ids, no tokenizer
    agent = Agent(f"random {ctx.args.vllm_arch} x {ctx.args.vllm_layers} layers", None, None, (model, tokenizer))
    options = {"gpu_memory_utilization": 0.3, "enable_sleep_mode": True, "max_model_len": 512}
    engine = VLLMEngine(**{**options, **json.loads(ctx.args.vllm_options)})
    engine.check_team([agent], "cuda")
    ctx.vllm_started = True
    free_model(ctx)  # the cache emptied
    base = device_used()  # the trainer's model resident, no vLLM yet
    prompts = torch.randint(1, config.vocab_size - 1, (4, 8), generator=torch.Generator().manual_seed(0)).tolist()
    cycles = []
    for cycle in range(3):
        cycles.append(vllm_round(engine, agent, prompts, base))
        with torch.no_grad():  # an optimizer step's in-place change: the next wake syncs new weights
            for p in model.parameters():
                p.mul_(1.0 + 0.01 * (cycle + 1))
    asleep, diffs = max(c["asleep_gib"] for c in cycles), [c["max_logprob_diff"] for c in cycles]
    record = {"cycles": cycles, "options": engine.options("cuda"), "planned_asleep_gib": gib(VLLM_ASLEEP)}
    record["asleep_ratio"] = ratio(asleep, gib(VLLM_ASLEEP))
    record["note"] = "a random model's logits are nearly flat: greedy ties make token agreement a weak signal"
    record["summary"] = (
        f"max log-prob diffs {diffs}, agreement {[c['token_agreement'] for c in cycles]}, asleep {asleep} vs "
        f"{gib(VLLM_ASLEEP)} GiB, awake {max(c['awake_gib'] for c in cycles)} GiB"
    )
    return record


CHECKS = (check_context, check_per_layer_pass, check_streamed_sync, check_padding_passes, check_setup, check_vllm_cycle)


def run_check(name: str, check, ctx, path: Path) -> dict:
    """One check in its own try: its record (ok, failed, skipped or error), printed and appended to ``path``."""
    start = time.perf_counter()
    try:
        record = {"check": name, "status": "ok", **check(ctx)}
    except Skipped as e:
        record = {"check": name, "status": "skipped", "reason": str(e), "summary": str(e)}
    except Exception as e:  # noqa: BLE001 - every check records its failure and the next one runs
        where = traceback.extract_tb(e.__traceback__)[-1]
        record = {"check": name, "status": "error", "error": repr(e)[:600], "where": f"{where.filename}:{where.lineno}"}
        record["summary"] = record["error"][:300]
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    record["seconds"] = round(time.perf_counter() - start, 2)
    print(f"{name:<15} {record['status']:<8} {record['summary']}", flush=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def init_world(ctx) -> None:
    """A ``torch.distributed`` world of 1 on a free local port, and its 1-D device mesh."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if ctx.device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        ctx.mesh = init_device_mesh(ctx.device.type, (1,))
    except Exception as e:  # noqa: BLE001 - the FSDP checks say why they are skipped
        ctx.mesh_error = repr(e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/lit_marl_gpu_check_scale")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script")
    parser.add_argument("--arch", default="7b", choices=[*ARCHS, "tiny"], help="plan_memory's table, or a tiny Qwen2")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 4; tiny: its own 2)")
    parser.add_argument("--tokens", type=int, help="tokens of the update pass (default: 4096; tiny: 256)")
    parser.add_argument("--gather-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vllm-arch", default="1.5b", choices=[*ARCHS, "tiny"])
    parser.add_argument("--vllm-layers", type=int, default=2)
    parser.add_argument("--vllm-options", default="{}", help="JSON: more vllm.LLM options (enforce_eager, ...)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check_scale.py needs a CUDA GPU (--device cpu runs it as a smoke test)")
    path = Path(args.out) / "gpu_check_scale.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    ctx = SimpleNamespace(args=args, device=torch.device(args.device), mesh=None, mesh_error=None)
    ctx.model, ctx.shards, ctx.vllm_started = None, None, False
    init_world(ctx)
    ctx.config = architecture(args.arch, args.layers if args.layers or args.arch == "tiny" else 4)
    ctx.tokens = args.tokens or (256 if args.arch == "tiny" else 4096)
    import transformers

    print(
        f"gpu_check_scale: {args.arch} x {ctx.config.num_hidden_layers} layers, {ctx.tokens} tokens, {args.device}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        flush=True,
    )
    records = [run_check(check.__name__.removeprefix("check_"), check, ctx, path) for check in CHECKS]
    print(json.dumps({"torch": torch.__version__, "records": records}), flush=True)
    if ctx.vllm_started:  # vLLM's shutdown under an external launcher can hang: the records are out
        os._exit(0)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
