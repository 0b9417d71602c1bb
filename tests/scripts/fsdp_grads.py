"""Two ranks (gloo) shard one tiny model with ``lit_marl.parallel.fsdp.TeamShards`` and run different numbers
of forward/backward passes, and generate different numbers of tokens, inside ``gathered()``; after
``reduce_gradients`` each rank's gradient shards must equal the gradients of one process that ran
every pass. With ``checkpointing`` the sharded model recomputes its layers in the backward
(``lit_marl.models.checkpoint_layers``; the one process does not). With ``bf16`` the MLP weights are
frozen and stored in bf16 (``store_frozen``, as ``model.memory.weights_dtype: bfloat16`` does), so each layer's
FSDP unit gathers bf16 and fp32 parameters together, and every pass runs under bf16 autocast (both
sides).

With ``--per-layer`` the model is sharded per layer (``TeamShards(mode="per_layer")``): only the
generation runs inside ``gathered()``; the passes run through ``lockstep`` (rank 1: 1 real pass and
2 padding passes), each backward reduce-scatters. Every collective each rank issues is traced
(``collective_trace``) and written to the report. ``--no-padding`` (the negative control) runs the
passes without ``lockstep``, with a 20 s collective timeout: it must fail, not hang.
Writes OUT/report_rank{r}.json.

python fsdp_grads.py OUT PORT [checkpointing|bf16|bf16gather] [--per-layer] [--no-padding]
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # collective_trace

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def loss_of(model, ids):
    return model(input_ids=ids).logits.float().log_softmax(-1).mean()


def run_passes(model, batches, autocast, in_backward) -> None:
    from lit_marl.models import checkpointed_passes

    with checkpointed_passes(model), autocast:
        for ids in batches:
            loss = loss_of(model, ids)
            in_backward[0] = True
            loss.backward()
            in_backward[0] = False


def worker(rank: int, world: int, folder: str, port: str, mode: str, per_layer: bool, padding: bool) -> None:
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lit_marl.models import checkpoint_layers, load_model_and_tokenizer, store_frozen
    from lit_marl.parallel.fsdp import TeamShards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20 if per_layer else 600))
    model, _ = load_model_and_tokenizer("tiny-random")
    if mode == "bf16":
        for name, p in model.named_parameters():
            p.requires_grad_("mlp" not in name)
        store_frozen(model, "bfloat16")
    single = copy.deepcopy(model)
    checkpoint_layers(model, mode == "checkpointing")
    # no weight cache, as Lightning's precision plugin: the loop runs in one autocast block
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16", cache_enabled=False)
    recomputed = [0]  # layer passes during a backward
    in_backward = [False]
    attention = model.model.layers[0].self_attn
    attention.register_forward_hook(lambda *_: recomputed.__setitem__(0, recomputed[0] + in_backward[0]))
    from collective_trace import CollectiveTrace

    # bf16gather: decoder layers gathered and computing in bf16 (gradients reduced in fp32); the one
    # process it is compared with runs under bf16 autocast
    gather = "bfloat16" if mode == "bf16gather" else "float32"
    shards = TeamShards([model], init_device_mesh("cpu", (world,)), "per_layer" if per_layer else "gathered", gather)
    single_autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode in ("bf16", "bf16gather"))
    batches = [torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(100 + i)) for i in range(4)]
    mine = batches[:3] if rank == 0 else batches[3:]  # 3 passes on rank 0, 1 on rank 1
    new_tokens = 4 + 16 * rank
    params = list(model.parameters())  # the sharded parameters, as an optimizer holds them
    with CollectiveTrace() as trace:
        with shards.gathered():
            with autocast:
                out = model.generate(
                    input_ids=torch.tensor([[5, 6, 7]]),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=True,
                )
            if not per_layer:
                run_passes(model, mine, autocast, in_backward)
                shards.reduce_gradients(params)
                shards.refresh(params)
        if per_layer:
            run_passes(model, shards.lockstep(mine, [model], backward=True) if padding else mine, autocast, in_backward)
    local = {n: p.to_local().shape[0] for n, p in model.named_parameters() if isinstance(p, DTensor)}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    for ids in batches:
        with single_autocast:
            loss = loss_of(single, ids)
        loss.backward()
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in single.named_parameters() if p.requires_grad)
    relative = max(
        float((grads[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-12))
        for n, p in single.named_parameters()
        if p.requires_grad
    )
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    report = {
        "rank": rank,
        "generated": out.shape[1] - 3,
        "max_grad_diff": worst,
        "relative_grad_diff": relative,
        "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
        "embed_rows": local["model.embed_tokens.weight"],
        "sharded": len(local),
        "params": len(list(model.parameters())),
        "trained": len(grads),
        "dtypes": dtypes,
        "recomputed": recomputed[0],
        "collectives": trace.calls,
    }
    (Path(folder) / f"report_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    flags = [a for a in sys.argv[3:] if a.startswith("--")]
    variant = ([a for a in sys.argv[3:] if not a.startswith("--")] or [""])[0]
    mp.spawn(
        worker,
        args=(2, sys.argv[1], sys.argv[2], variant, "--per-layer" in flags, "--no-padding" not in flags),
        nprocs=2,
    )
