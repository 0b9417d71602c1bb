"""MADPO / iterative MADPO runs for the distributed pairs test (Lightning re-launches it per rank).

python preference_run.py OUT --algorithm madpo|iterative --devices N --tasks-per-step B --steps S

Per-task sampling streams (``data.sampling_streams: per_task``), so a task samples the same
candidates on any number of ranks. Every rank appends the pairs it trains on to
OUT/pairs_rank{r}.jsonl (per pair: the step, every agent's prompt, chosen and rejected token ids)
and saves its parameters to OUT/params_rank{r}.pt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from helpers import LENGTH_REWARD, make_trainer, slogan_data  # noqa: E402
from lit_marl.algorithms import MADPO, IterativeMADPO  # noqa: E402
from lit_marl.parallel.strategies import TeamDDPStrategy  # noqa: E402


def recording(base: type) -> type:
    class Recording(base):
        def dpo_update(self, agents, chosen, rejected, gaps):
            records = []
            for p in range(len(chosen)):
                record = {"step": self.trainer.fit_loop.total_batch_idx, "gap": round(float(gaps[p]), 5)}
                for i, s in enumerate(agents):
                    prompt = s.input_ids.shape[1] - s.num_completion
                    row_w, row_l = int(chosen[p]), int(rejected[p])
                    record[f"prompt{i}"] = s.input_ids[row_w, :prompt][s.attention_mask[row_w, :prompt].bool()].tolist()
                    record[f"chosen{i}"] = s.input_ids[row_w, prompt:][s.completion_mask[row_w].bool()].tolist()
                    record[f"rejected{i}"] = s.input_ids[row_l, prompt:][s.completion_mask[row_l].bool()].tolist()
                records.append(json.dumps(record, sort_keys=True))
            with open(self.out / f"pairs_rank{self.global_rank}.jsonl", "a") as f:
                f.write("".join(r + "\n" for r in records))
            return super().dpo_update(agents, chosen, rejected, gaps)

    return Recording


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--algorithm", choices=["madpo", "iterative"], required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tasks-per-step", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    settings = dict(model="tiny-random", num_agents=2, learning_rate=1e-2, candidate_policy="current")
    if args.algorithm == "madpo":
        module = recording(MADPO)(**settings)
    else:  # the comparator is the live policy on its own streams; pairs of the step only (no replay draw)
        settings.pop("candidate_policy")
        module = recording(IterativeMADPO)(**settings, num_iterations=args.steps, comparator_policy="current")
    module.out = args.out
    data = slogan_data(
        reward_fn=LENGTH_REWARD,
        num_generations=4,
        sampling={"max_new_tokens": 12},
        tasks_per_step=args.tasks_per_step,
        sampling_streams="per_task",
    )
    trainer = make_trainer(
        args.out,
        logger=False,
        devices=args.devices,
        strategy=TeamDDPStrategy() if args.devices > 1 else "auto",
        limit_train_batches=args.steps,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    params = {
        f"{i}.{n}": p.detach().clone() for i, a in enumerate(module.agents) for n, p in a.model.named_parameters()
    }
    torch.save(params, args.out / f"params_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
