"""Where an episode algorithm's training step goes (PPO, GRPO, RLOO on multi-turn episodes): a real
fit of a config's model and data module for a few steps, its callbacks left out (no held-out
evaluation, no SFT phase), with each part of the step timed and the process's peak RSS read per phase.

    .venv/bin/python scripts/bench_ppo_update.py --config configs/ppo/corridor_smollm2.yaml --steps 1
    .venv/bin/python scripts/bench_ppo_update.py --config configs/textworld/sft_ppo_cpu.yaml --steps 2

The update is split into the no-grad passes before the loss (the behaviour log-probs with the old
values, the reference's log-probs, the advantages), the loss passes' forwards and backwards and the
optimizer steps; the forwards into the decoder's layers and the LM head (module hooks, forward and
backward); and every pass's padded tokens against its real ones. ``--set key=value`` overrides a
``model.``/``data.`` init argument (YAML values: ``--set model.update.ppo_epochs=1``). ``--save-batch`` keeps
the rollouts' episodes and ``--load-batch`` trains on them instead of rolling out (the "rollout" is
then the read): two versions of the update timed on the same episodes. Prints one line per part
and a JSON object last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_workload as workload  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402

from lit_marl import cpu  # noqa: E402
from lit_marl.algorithms.base import AgentTeamModule  # noqa: E402
from lit_marl.algorithms.episodic import EpisodicModule  # noqa: E402
from lit_marl.data import EpisodeDataModule  # noqa: E402

GiB = 2**30
TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
PEAKS: dict[str, float] = {}
PASSES: list[dict] = []


def rss(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return float(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def timed(owner, name: str, label: str, phase: bool = False) -> None:
    """``owner.name`` timed into ``label``; a ``phase`` also has its peak RSS read (reset as it starts)."""
    fn = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if phase:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak RSS starts again from the current RSS
        start = time.perf_counter()
        COUNTS[label] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start
            if phase:
                PEAKS[label] = max(PEAKS.get(label, 0.0), rss("VmHWM"))

    setattr(owner, name, wrapped)


class Clock:
    """Forward and backward time of a set of modules, summed (pre/post hooks; the backward's through
    full backward hooks, which see the gradient flow in and out of each module)."""

    def __init__(self, label: str, modules: list[torch.nn.Module]):
        self.label, self.starts = label, {}
        for m in modules:
            m.register_forward_pre_hook(lambda m, *_: self._start(m, "fwd"))
            m.register_forward_hook(lambda m, *_: self._stop(m, "fwd"))
            m.register_full_backward_pre_hook(lambda m, *_: self._start(m, "bwd"))
            m.register_full_backward_hook(lambda m, *_: self._stop(m, "bwd"))

    def _start(self, module, kind):
        self.starts[(id(module), kind)] = time.perf_counter()

    def _stop(self, module, kind):
        grad = "" if kind == "bwd" else ("grad " if torch.is_grad_enabled() else "no-grad ")
        TIMES[f"{self.label} {grad}{kind}"] += time.perf_counter() - self.starts.pop((id(module), kind))


def record_pass(module, args, kwargs) -> None:
    """Each forward of a policy: its rows, padded width, real tokens and the positions its LM head runs on."""
    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if ids is None or mask is None:
        return
    keep = kwargs.get("logits_to_keep")
    head = int(keep.sum()) if isinstance(keep, torch.Tensor) else (ids.numel() if not keep else keep * ids.shape[0])
    PASSES.append(
        {
            "grad": torch.is_grad_enabled(),
            "rows": ids.shape[0],
            "width": ids.shape[1],
            "padded": ids.numel(),
            "real": int(mask.sum()),
            "head_positions": head,
        }
    )


class Instrument(L.Callback):
    def on_fit_start(self, trainer, pl_module):
        for agent in pl_module.agents:
            model = agent.model
            model.register_forward_pre_hook(record_pass, with_kwargs=True)
            layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
            Clock("decoder layers", layers)
            Clock("lm head", [model.get_output_embeddings()])


def replayed(save: Path | None, load: Path | None) -> None:
    """The rollout's batches saved to ``save``, or read back from ``load`` in their place (the same
    episodes for two versions of the update: a rollout samples other episodes each run)."""
    saved, fn = [], EpisodeDataModule.on_after_batch_transfer
    loaded = torch.load(load, weights_only=False) if load else None

    def wrapped(self, batch, dataloader_idx):
        if loaded is not None:
            return loaded[COUNTS["rollout"] - 1]  # counted by ``timed`` as it starts
        saved.append(fn(self, batch, dataloader_idx))
        if save:
            torch.save(saved, save)
        return saved[-1]

    EpisodeDataModule.on_after_batch_transfer = wrapped


def instrument(module_cls) -> None:
    timed(EpisodeDataModule, "on_after_batch_transfer", "rollout", phase=True)
    timed(module_cls, "training_step", "update", phase=True)
    timed(EpisodicModule, "prepare", "update: before the loss (no grad)")
    timed(module_cls, "behaviour", "  behaviour pass (log-probs, values)")
    timed(EpisodicModule, "reference_logprobs", "  reference pass")
    timed(module_cls, "advantages", "  advantages")
    timed(AgentTeamModule, "optimizer_step_on", "update: optimizer steps (all)")
    timed(EpisodicModule, "loss", "  loss forwards")
    timed(AgentTeamModule, "manual_backward", "  backwards")


def load(config: Path, overrides: list[str]):
    spec = yaml.safe_load(config.read_text())
    for item in overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        spec[section]["init_args"][name] = yaml.safe_load(value)

    def build(section):
        path = spec[section]["class_path"]
        cls = getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1])
        return cls, spec[section].get("init_args", {})

    return build("model"), build("data"), spec.get("seed_everything", 0)


def report(args, wall: float) -> dict:
    steps = max(COUNTS["update"], 1)
    lines = []
    for label in sorted(TIMES, key=lambda k: (not k.startswith(("rollout", "update")), k)):
        lines.append(f"{label:<42} {TIMES[label] / steps:8.2f} s per step ({COUNTS.get(label, '-')} calls)")
    passes = {"no-grad": [p for p in PASSES if not p["grad"]], "grad": [p for p in PASSES if p["grad"]]}
    for kind, rows in passes.items():
        padded, real = sum(p["padded"] for p in rows), sum(p["real"] for p in rows)
        head = sum(p["head_positions"] for p in rows)
        if rows:
            lines.append(
                f"{kind} passes: {len(rows) / steps:.1f} per step, {padded / steps:.0f} padded tokens "
                f"({real / steps:.0f} real, padding {1 - real / padded:.0%}), LM head on {head / steps:.0f} positions"
            )
    for phase, peak in PEAKS.items():
        lines.append(f"peak RSS in {phase}: {peak / GiB:.2f} GiB")
    print("\n".join(lines))
    return {
        "config": str(args.config),
        "steps": steps,
        "wall_s": wall,
        "seconds_per_step": {k: v / steps for k, v in TIMES.items()},
        "calls": dict(COUNTS),
        "passes": PASSES,
        "peak_rss_gib": {k: v / GiB for k, v in PEAKS.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/ppo/corridor_smollm2.yaml")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="model.KEY=VALUE or data.KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--save-batch", type=Path, default=None, help="save the rollouts' episodes here")
    parser.add_argument("--load-batch", type=Path, default=None, help="train on these saved episodes (no rollout)")
    args = parser.parse_args()
    (model_cls, model_args), (data_cls, data_args), seed = load(args.config, args.set)
    replayed(args.save_batch, args.load_batch)
    instrument(model_cls)
    L.seed_everything(seed, verbose=False)
    module, data = model_cls(**model_args), data_cls(**data_args)
    precision = cpu.auto_precision("cpu") or "32-true"
    trainer = workload.bench_trainer(args.steps, devices=1, precision=precision, callbacks=[Instrument()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    result = report(args, time.perf_counter() - start)
    if args.out:
        args.out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "passes"}))


if __name__ == "__main__":
    main()
