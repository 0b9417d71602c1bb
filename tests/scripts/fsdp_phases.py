"""A per-layer FSDP2 fit on 2 gloo ranks that records what each phase gathers whole, against the
memory plan's list, and how the models were loaded.

MAGRPO with a KL reference (two agents, each with its frozen copy), rollouts and held-out
evaluations by a vLLM engine whose backend records the weights it receives and answers fixed
tokens (``--engine vllm``), or by the torch decoder (``--engine torch``). Every whole-model gather
(``TeamShards._unshard``) is recorded with the phase it happens in: ``setup``, ``rollout`` (the data
module's rollout of a training batch), ``evaluation`` (``HeldOutEvaluation``) or ``update`` (the
training step: MAGRPO's reference KL and its update). Each rank writes OUT/phases_rank{r}.json:
the recorded gathers and the plan's ``gathered`` per phase (model names in the module), the number
of weight files it read (rank 1 builds on the meta device), the collectives of the setup (traced),
and a checksum of every weight after setup (the full tensors) beside that of the weights as loaded
in one process.

python fsdp_phases.py OUT --engine vllm|torch
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # collective_trace

import lightning as L  # noqa: E402
import transformers  # noqa: E402
from collective_trace import CollectiveTrace  # noqa: E402

from helpers import make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import MAGRPO  # noqa: E402
from lit_marl.callbacks import HeldOutEvaluation  # noqa: E402
from lit_marl.data import RolloutDataModule  # noqa: E402
from lit_marl.parallel.fsdp import TeamShards  # noqa: E402
from lit_marl.parallel.strategies import TeamFSDPStrategy  # noqa: E402

STATE = {"phase": "setup", "gathers": [], "reads": 0, "names": {}}
TRACE = CollectiveTrace()
SHARDED_PARTS = ("weights", "layers gathered in a pass", "gradients", "AdamW state")


def recording(fn, phase: str):
    def wrapped(*args, **kwargs):
        before, STATE["phase"] = STATE["phase"], phase
        try:
            return fn(*args, **kwargs)
        finally:
            STATE["phase"] = before

    return wrapped


_unshard = TeamShards._unshard


def unshard(self, roots):
    if roots:
        STATE["gathers"].append([STATE["phase"], sorted(STATE["names"].get(id(r), "?") for r in roots)])
    return _unshard(self, roots)


TeamShards._unshard = unshard
RolloutDataModule.on_after_batch_transfer = recording(RolloutDataModule.on_after_batch_transfer, "rollout")
HeldOutEvaluation.evaluate = recording(HeldOutEvaluation.evaluate, "evaluation")
MAGRPO.training_step = recording(MAGRPO.training_step, "update")
_from_pretrained = transformers.AutoModelForCausalLM.from_pretrained.__func__


def counted_from_pretrained(cls, *args, **kwargs):
    STATE["reads"] += 1
    return _from_pretrained(cls, *args, **kwargs)


transformers.AutoModelForCausalLM.from_pretrained = classmethod(counted_from_pretrained)


class FixedBackend:
    """A vLLM backend that takes the synced weights and answers the same tokens."""

    sleeps = False

    def load_weights(self, weights):
        for _ in weights:
            pass

    def generate(self, prompts, params, adapter=None):
        from lit_marl.generation.vllm import Sample

        tokens = [40, 41, 42][: params["max_tokens"]]
        return [[Sample(tokens, "length", [-1.0] * len(tokens)) for _ in range(params["n"])] for _ in prompts]


class Checksums(L.Callback):
    """Every weight as the fit starts (full tensors), summed: rank 0's loaded and rank 1's received."""

    def on_fit_start(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        STATE["setup_collectives"] = list(TRACE.calls)  # loading and sharding: every collective so far

        from lit_marl.memory import model_names, plan

        STATE["names"] = model_names(pl_module)
        sums = {}
        for name, p in pl_module.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            sums[name] = float(full.detach().double().sum())
        STATE["sums"] = sums
        result = plan(pl_module, pl_module.rollout_settings)
        STATE["plan"] = result.gathered
        STATE["parts"] = {k: result.parts[k] for k in SHARDED_PARTS}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--engine", choices=["vllm", "torch"], required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, kl={"coef": 0.1}, learning_rate=1e-3)
    data = slogan_data(tasks_per_step=2, num_generations=2, sampling={"max_new_tokens": 3}, eval_tasks_per_step=2)
    if args.engine == "vllm":
        from lit_marl.generation.vllm import VLLMEngine

        data.engine = VLLMEngine(backend_factory=lambda agent, dtype: FixedBackend())
    strategy = TeamFSDPStrategy(mode="per_layer", save_distributed_checkpoint=False)
    trainer = make_trainer(
        args.out,
        callbacks=[Checksums(), HeldOutEvaluation(examples=0)],
        logger=False,
        devices=2,
        strategy=strategy,
        limit_train_batches=1,
        limit_val_batches=0,
    )
    with TRACE:
        trainer.fit(module, datamodule=data)
    report = {k: STATE[k] for k in ("gathers", "reads", "sums", "plan", "parts", "setup_collectives")}
    (args.out / f"phases_rank{trainer.global_rank}.json").write_text(json.dumps(report))
    if trainer.global_rank == 0:  # the weights as one process loads them (the same seed)
        L.seed_everything(0)
        alone = MAGRPO(model="tiny-random", num_agents=2, kl={"coef": 0.1})
        alone.configure_model()
        sums = {n: float(p.detach().double().sum()) for n, p in alone.named_parameters()}
        (args.out / "loaded_alone.json").write_text(json.dumps(sums))
        from lit_marl.memory import plan

        ahead = plan(alone, shard_over=2, mode="per_layer").parts  # planned before sharding, as plan_memory does
        (args.out / "planned_ahead.json").write_text(json.dumps({k: ahead[k] for k in SHARDED_PARTS}))


if __name__ == "__main__":
    main()
