"""Every phase of a sharded run against the memory plan, on 2 CPU ranks: peak RSS per rank in each
phase (setup, rollout, evaluation, update) beside the plan's figure for it.

A GRPO fit on the Corridor game in per-layer FSDP2 over 2 gloo ranks (one agent, a KL reference
stored in bf16, bf16-mixed, the torch decoder generating), two training steps (the second's rollout
and update hold AdamW's state, as every later step does) with a held-out evaluation before and
after. Each phase resets the process's peak RSS as it starts (``/proc/self/clear_refs``) and reads
it as it ends: ``setup`` is the module's ``configure_model`` (loading and sharding), ``rollout`` the
data module's rollout of the training batch, ``evaluation`` the held-out evaluations, ``update`` the
training step. Also the weights each rank holds after
setup (a checksum of every full tensor) and how many weight files it read.

    MALLOC_MMAP_THRESHOLD_=131072 .venv/bin/python scripts/bench_phases.py --model smollm2-135m-instruct

``MALLOC_MMAP_THRESHOLD_=131072`` returns freed blocks to the system (docs/scale.md: glibc's default
keeps them mapped and the RSS then runs above the live bytes). Prints one line per rank and phase.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_workload as workload  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from lit_marl.algorithms import GRPO  # noqa: E402
from lit_marl.algorithms.base import AgentTeamModule  # noqa: E402
from lit_marl.callbacks import HeldOutEvaluation  # noqa: E402
from lit_marl.data import EpisodeDataModule  # noqa: E402
from lit_marl.parallel.strategies import TeamFSDPStrategy  # noqa: E402

GiB = 2**30
PEAKS: dict[str, float] = {}
CALLS: list[tuple[str, float, float]] = []  # (phase, RSS as it starts, its peak) of every call
STATE = {"reads": 0, "before_setup": 0.0}


def rss(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return float(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def measured(fn, phase: str):
    """``fn`` with the process's peak RSS over each call recorded as ``phase``'s (the most over calls)."""

    def wrapped(*args, **kwargs):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from the current RSS
        start = rss()
        if phase == "setup":
            STATE["before_setup"] = start
        try:
            return fn(*args, **kwargs)
        finally:
            PEAKS[phase] = max(PEAKS.get(phase, 0.0), rss("VmHWM"))
            CALLS.append((phase, start, rss("VmHWM")))

    return wrapped


AgentTeamModule.configure_model = measured(AgentTeamModule.configure_model, "setup")
EpisodeDataModule.on_after_batch_transfer = measured(EpisodeDataModule.on_after_batch_transfer, "rollout")
HeldOutEvaluation.evaluate = measured(HeldOutEvaluation.evaluate, "evaluation")
GRPO.training_step = measured(GRPO.training_step, "update")
_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained.__func__


def counted(cls, *args, **kwargs):
    STATE["reads"] += 1
    return _from_pretrained(cls, *args, **kwargs)


transformers.AutoModelForCausalLM.from_pretrained = classmethod(counted)


class Planned(L.Callback):
    """The plan of this rank as the fit starts (each phase's figure), and every weight's checksum."""

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        from lit_marl.memory import PHASES, plan

        result = plan(pl_module, pl_module.rollout_settings)
        STATE["plan"] = {phase: result.phase(phase) for phase in PHASES}
        STATE["table"] = result.table()
        sums = {}
        for name, p in pl_module.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            sums[name] = float(full.detach().double().sum())
        STATE["sums"] = sums
        STATE["full_fp32_bytes"] = 4 * sum(p.numel() for p in pl_module.agents[0].model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "lit_marl_bench_phases")
    parser.add_argument("--token-budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="training steps (from the second, AdamW's state is held)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    module = GRPO(
        model=args.model,
        kl={"coef": 0.05},
        memory={"weights_dtype": "bfloat16", "forward_token_budget": args.token_budget},
    )
    heldout = args.out / "heldout.jsonl"
    heldout.write_text("".join((ROOT / "data/corridor/heldout.jsonl").read_text().splitlines(True)[:4]))
    data = EpisodeDataModule(
        env="corridor",
        train_path=str(ROOT / "data/corridor/train.jsonl"),
        val_path=str(heldout),
        tasks_per_step=2,
        num_generations=4,
        max_turns=4,
        sampling={"max_new_tokens": 8},
        eval_tasks_per_step=2,
    )
    trainer = workload.bench_trainer(
        args.steps,
        devices=2,
        strategy=TeamFSDPStrategy(mode="per_layer", save_distributed_checkpoint=False),
        precision="bf16-mixed",
        default_root_dir=args.out,
        callbacks=[Planned(), HeldOutEvaluation(examples=0)],
    )
    trainer.fit(module, datamodule=data)
    rank = trainer.global_rank
    report = {"peaks": PEAKS, "calls": CALLS, **STATE}
    (args.out / f"phases_rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    if rank != 0:
        return
    reports = [json.loads((args.out / f"phases_rank{r}.json").read_text()) for r in range(2)]
    print(reports[0]["table"])
    for r, rep in enumerate(reports):
        for phase, peak in rep["peaks"].items():
            planned = rep["plan"][phase]
            print(
                f"rank {r} {phase:<10} measured peak RSS {peak / GiB:6.2f} GiB  planned {planned / GiB:6.2f} GiB  "
                f"planned/measured {planned / peak:5.2f}"
            )
    for phase, start, peak in reports[1]["calls"]:
        print(f"rank 1 {phase:<10} starts at {start / GiB:6.2f} GiB, peaks at {peak / GiB:6.2f} GiB")
    grown = reports[1]["peaks"]["setup"] - reports[1]["before_setup"]
    print(
        f"rank 1 setup: +{grown / GiB:.2f} GiB over its RSS before loading (one full fp32 copy of the model: "
        f"{reports[1]['full_fp32_bytes'] / GiB:.2f} GiB); weight files read: rank 0 {reports[0]['reads']}, "
        f"rank 1 {reports[1]['reads']}; same weights on both ranks: {reports[0]['sums'] == reports[1]['sums']}"
    )


if __name__ == "__main__":
    main()
