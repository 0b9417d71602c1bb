"""DDP runs for the distributed tests, launched as a script (Lightning re-launches it per rank).

python ddp_run.py OUT --build --tasks-per-step B --steps S      # sampled rollouts of every task, once
python ddp_run.py OUT --devices N --tasks-per-step B --steps S [--train-batch-size K] [--algorithm ...] [--fsdp]
    [--evaluate] [--validate]

Training steps replay the built rollouts of their tasks, so runs with different numbers of ranks
train on identical samples (sampling in one process and in two draws different random numbers). The
tasks that land on rank 0 of a 2-rank run score 1.0 at turn 0 and end early (early termination),
so rank 0's trees are shorter than rank 1's. Each rank saves its parameters to OUT/params_rank{r}.pt
(full tensors; under ``--fsdp`` also the shapes of its local shards, in OUT/shards_rank{r}.json).
``--sample`` trains on fresh samples instead of the built rollouts, rank r generating up to 6 + 6r
tokens per response (generation on sharded weights with a different number of decoding steps per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # collective_trace

import lightning as L  # noqa: E402
import torch  # noqa: E402
from collective_trace import CollectiveTrace  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from helpers import make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import IAC, MAAC, MAGRPO  # noqa: E402
from lit_marl.callbacks import HeldOutEvaluation  # noqa: E402
from lit_marl.data import RolloutDataModule  # noqa: E402
from lit_marl.envs.slogan import reward as slogan_reward  # noqa: E402
from lit_marl.parallel.strategies import TeamDDPStrategy, TeamFSDPStrategy  # noqa: E402
from lit_marl.rollout.batch import AgentSamples, RolloutBatch  # noqa: E402
from lit_marl.tasks import TaskLoader  # noqa: E402


def key(task: dict) -> str:
    return json.dumps(task, sort_keys=True)


def data_kwargs(algorithm: str, tasks_per_step: int) -> dict:
    generations = 2 if algorithm == "magrpo" else 1
    return dict(
        num_generations=generations,
        num_turns=2,
        transition="lit_marl.rollout.transitions:plain",
        sampling={"max_new_tokens": 10},
        tasks_per_step=tasks_per_step,
        early_termination_threshold=0.99,
    )


def build(out: Path, algorithm: str, tasks_per_step: int, steps: int) -> None:
    """Per task, one sampled tree; the first half of every step's tasks (rank 0's) stops early."""
    import copy

    from lit_marl.agents import Agent
    from lit_marl.rollout.tree import build_tree

    data = slogan_data(**data_kwargs(algorithm, tasks_per_step))
    loader = TaskLoader(data.train_tasks, tasks_per_step, data.hparams.seed)
    order = loader.order(0)
    stop = {
        key(data.train_tasks[i])
        for s in range(steps)
        for i in order[s * tasks_per_step : s * tasks_per_step + tasks_per_step // 2]
    }

    def reward(agent_completions, tasks):
        base = slogan_reward(agent_completions, tasks)["reward"]
        return [1.0 if key(t) in stop else 0.9 * r for t, r in zip(tasks, base)]

    torch.manual_seed(0)
    agents = [Agent("tiny-random"), Agent("tiny-random")]
    env = copy.copy(data.env)  # the data's prompts and transition, scored by the reward above
    env.reward_fn = reward
    rollouts = {}
    for i in order[: steps * tasks_per_step]:
        task = data.train_tasks[i]
        batch = build_tree(agents, [task], env, data.tree)
        batch.score(discount=1.0)  # the algorithm's (MAGRPO's default); replayed batches carry their returns
        rollouts[key(task)] = {"agents": [vars(s) for s in batch.agents], "rewards": batch.rewards}
    torch.save(rollouts, out / "rollouts.pt")


class Replay(RolloutDataModule):
    """Training batches replay the built rollouts of their tasks (node ids offset per task)."""

    def rollout(self, agents, tasks, greedy):
        if greedy:
            return super().rollout(agents, tasks, greedy)
        saved = [self.rollouts[key(t)] for t in tasks]
        per_agent = []
        for i in range(len(agents)):
            parts, offset = [], 0
            for s in saved:
                fields = dict(s["agents"][i])
                nodes = int(fields["group_ids"].max()) + 1
                fields["group_ids"] = fields["group_ids"] + offset
                fields["next_group"] = torch.where(fields["next_group"] >= 0, fields["next_group"] + offset, -1)
                parts.append(AgentSamples(**fields))
                offset += nodes
            per_agent.append(AgentSamples.cat(parts, agents[i].pad_token_id))
        return RolloutBatch(agents=per_agent, rewards=torch.cat([s["rewards"] for s in saved]))


class GeneratedLengths(L.Callback):
    """The longest response of each training batch on this rank (its number of decoding steps)."""

    def __init__(self):
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(max(int(s.completion_mask.sum(-1).max()) for s in batch.agents))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--build", action="store_true")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tasks-per-step", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--train-batch-size", type=int)
    parser.add_argument("--algorithm", default="magrpo")
    parser.add_argument("--update-schedule", default="joint")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--fsdp-mode", default="gathered", help="TeamFSDPStrategy's mode; per_layer also traces")
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--evaluate", action="store_true", help="held-out before/after: OUT/heldout_rank{r}.json")
    parser.add_argument("--validate", action="store_true", help="Lightning's validation loop: one batch after the fit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.build:
        return build(args.out, args.algorithm, args.tasks_per_step, args.steps)
    L.seed_everything(0)
    kwargs = dict(
        model="tiny-random",
        num_agents=2,
        learning_rate=1e-2,
        update={"train_batch_size": args.train_batch_size},
        buffer={"schedule": args.update_schedule},
    )
    module = {"magrpo": MAGRPO, "iac": IAC, "maac": MAAC}[args.algorithm](**kwargs)
    hparams = slogan_data(**data_kwargs(args.algorithm, args.tasks_per_step)).hparams
    if args.sample:
        # each rank decodes its own number of tokens (the random model seldom ends a response early)
        rank = int(os.environ.get("LOCAL_RANK", 0))
        data = RolloutDataModule(**{**hparams, "sampling": {"max_new_tokens": 6 + 6 * rank}})
    else:
        data = Replay(**hparams)
        data.rollouts = torch.load(args.out.parent / "rollouts.pt")
    strategy = "auto"
    if args.devices > 1:
        fsdp = TeamFSDPStrategy(mode=args.fsdp_mode, save_distributed_checkpoint=False) if args.fsdp else None
        strategy = fsdp or TeamDDPStrategy()
    lengths = GeneratedLengths()
    evaluation = HeldOutEvaluation()
    trainer = make_trainer(
        args.out,
        callbacks=[lengths, evaluation] if args.evaluate else [lengths],
        logger=False,
        devices=args.devices,
        strategy=strategy,
        limit_train_batches=args.steps,
        limit_val_batches=1 if args.validate else 0,
    )
    with CollectiveTrace() as trace:  # every collective of the fit, in order: the same on every rank
        trainer.fit(module, datamodule=data)
    (args.out / f"collectives_rank{trainer.global_rank}.json").write_text(json.dumps(trace.calls))
    (args.out / f"mode_rank{trainer.global_rank}.txt").write_text(module.shards.mode if module.shards else "")
    (args.out / f"lengths_rank{trainer.global_rank}.json").write_text(json.dumps(lengths.seen))
    if args.evaluate:
        heldout = {"before": evaluation.before, "after": evaluation.after}
        (args.out / f"heldout_rank{trainer.global_rank}.json").write_text(json.dumps(heldout))
    named = [(f"{i}.{n}", p) for i, a in enumerate(module.agents) for n, p in a.model.named_parameters()]
    if args.algorithm != "magrpo":
        named += [(f"critic.{n}", p) for n, p in module.critics.named_parameters()]
    full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in named}
    torch.save(
        {name: p.detach().clone() for name, p in full.items()}, args.out / f"params_rank{trainer.global_rank}.pt"
    )
    if args.fsdp:
        shards = {name: list(p.to_local().shape) for name, p in named if isinstance(p, DTensor)}
        (args.out / f"shards_rank{trainer.global_rank}.json").write_text(json.dumps(shards))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (args.out / f"metrics_rank{trainer.global_rank}.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main()
