"""Benchmark: MAGRPO / IAC / MAAC training steps on a fixed workload, lit_marl and CoMLRL side by side.

The workload (scripts/bench_workload.py) is the same for both frameworks: a tiny random Qwen2 (or
``--model PATH``), one task per step, 2 agents, joint reward = character-set Jaccard + length ratio,
multi-turn transition "Your previous reply / Partner replies / Revise and combine both". One step =
one task's whole joint tree plus the updates its samples trigger; early termination off.

    .venv/bin/python scripts/bench_magrpo.py                                   # lit_marl, default grid
    .venv/bin/python scripts/bench_magrpo.py --framework lit_marl comlrl --repeats 3   # side by side
    .venv/bin/python scripts/bench_magrpo.py --num-generations 2 4 8 --num-turns 1 2 3 --floor

CoMLRL runs in its own virtual environment (scripts/setup_comlrl_venv.sh makes .venv-comlrl with
comlrl==1.4.3) through scripts/bench_comlrl_worker.py. Every measurement is a fresh process; the
frameworks alternate within each repeat, so machine noise hits both alike. For each configuration
the script prints median and min step time, generated tokens per step, tokens/s, generate calls,
reward calls, training forward passes, optimizer steps, peak RSS and the split of the step into
generate / reward+transition / train; ``--floor`` adds the batched floor (one generate of the same
number of sequences and tokens + one forward/backward over them). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_workload as workload  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from lit_marl.generation import Sampling  # noqa: E402

# --------------------------------------------------------------------------- lit_marl's reward and transition
PROBE = workload.StepProbe()


def _reward(agent_completions: list[list[str]], tasks: list[dict]) -> list[float]:
    """The workload's joint reward in lit_marl's batched form: one call per turn for all joint actions."""
    return [workload.joint_reward([agent[j] for agent in agent_completions]) for j in range(len(tasks))]


def _transition(*, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    partners = [[c for k, c in enumerate(agent_completions) if k != i] for i in range(num_agents)]
    return [workload.next_prompt(prompt, agent_completions[i], partners[i]) for i in range(num_agents)]


lit_reward = PROBE.timed(_reward, "reward_transition_s", "reward_calls")
lit_transition = PROBE.timed(_transition, "reward_transition_s", "transition_calls")


# --------------------------------------------------------------------------- one lit_marl measurement
def run_lit_marl(args) -> dict:
    from lit_marl.algorithms import IAC, MAAC, MAGRPO
    from lit_marl.data import RolloutDataModule

    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    total = args.warmup + args.steps
    folder = Path(tempfile.mkdtemp(prefix="bench_tasks_"))
    (folder / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in workload.tasks(total)))
    generations = args.num_generations if args.algorithm == "magrpo" else 1
    data = RolloutDataModule(
        train_path=str(folder / "train.jsonl"),
        agent_prompts=["{prompt}"] * args.num_agents,
        reward_fn="__main__:lit_reward",  # this module (its counters), not a second import of it
        tasks_per_step=1,
        num_generations=generations,
        joint_mode=args.joint_mode,
        sampling={"max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        num_turns=args.num_turns,
        transition="__main__:lit_transition" if args.num_turns > 1 else None,
        early_termination_threshold=None,
        engine=args.engine,
    )
    cls = {"magrpo": MAGRPO, "iac": IAC, "maac": MAAC}[args.algorithm]
    module = cls(model=args.model, num_agents=args.num_agents, learning_rate=args.lr)
    trainer = workload.bench_trainer(total, callbacks=[Probe()])
    trainer.fit(module, datamodule=data)
    result = PROBE.summary(args.warmup)
    if args.floor:
        result.update(floor(module, result, args.engine))
    return result


class Probe(L.Callback):
    """Delimits the training steps for ``PROBE`` and wraps the team's models once they exist."""

    def on_fit_start(self, trainer, pl_module):
        seen = set()
        models = [(agent.model, agent.pad_token_id) for agent in pl_module.agents]
        models += [(c.backbone, None) for c in getattr(pl_module, "critics", None) or [] if c.backbone is not None]
        for model, pad_id in models:
            if id(model) not in seen:
                seen.add(id(model))
                PROBE.wrap_model(model, pad_id, count_generate=False)
        PROBE.wrap_engine(trainer.datamodule.engine)
        register_optimizer_step_post_hook(PROBE.count_optimizer_step)

    def on_train_epoch_start(self, trainer, pl_module):
        PROBE.step_begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        PROBE.step_end()  # a step: from the previous step's end (its rollout included) to this one's
        PROBE.step_begin()


def floor(module, summary: dict, engine: str) -> dict:
    """One batched generate of the step's sequences and tokens (with the step's engine, every row
    the full length), and one batched forward/backward over them, on the first agent's model: what
    a step could cost at best."""
    from lit_marl.generation.decoder import Decoder, unsupported

    rows = max(1, round(summary["sequences_per_step"]))
    new = max(1, round(summary["generated_tokens_per_step"] / rows))
    prompt_len = max(1, round(summary["prompt_tokens_per_step"] / rows))
    agent = module.agents[0]
    model = agent.model  # called through its class: the probe's counting wrappers stay out
    lean = engine == "torch" or (engine == "auto" and unsupported(model) is None)
    torch.manual_seed(0)
    ids = torch.randint(10, 400, (rows, prompt_len))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            if lean:  # no end token (-1): every row decodes all `new` tokens
                every = Sampling(max_new_tokens=new)
                completion, _ = Decoder(model).generate(ids, torch.ones_like(ids), -1, agent.pad_token_id, every)
                out = torch.cat([ids, completion], dim=1)
            else:
                out = type(model).generate(
                    model,
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=0,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=agent.pad_token_id,
                )
        mid = time.perf_counter()
        logits = type(model).forward(model, input_ids=out).logits
        logits.float().log_softmax(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        times.append((mid - start, time.perf_counter() - mid))
    gen, train = min(times, key=sum)
    return {
        "floor_s": gen + train,
        "floor_generate_s": gen,
        "floor_train_s": train,
        "step_over_floor": summary["median_step_s"] / (gen + train),
    }


# --------------------------------------------------------------------------- the driver
def configurations(args) -> list[dict]:
    configs = []
    for algorithm, g, t, mode in itertools.product(
        args.algorithm, args.num_generations, args.num_turns, args.joint_mode
    ):
        if algorithm != "magrpo":
            g, mode = 1, "aligned"  # actor-critic: one trajectory per episode
        config = {"algorithm": algorithm, "num_generations": g, "num_turns": t, "joint_mode": mode}
        if config not in configs:
            configs.append(config)
    return configs


def worker_command(framework: str, config: dict, args) -> list[str]:
    common = [
        "--model",
        str(args.model),
        "--algorithm",
        config["algorithm"],
        "--num-agents",
        str(args.num_agents),
        "--num-generations",
        str(config["num_generations"]),
        "--num-turns",
        str(config["num_turns"]),
        "--joint-mode",
        config["joint_mode"],
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--temperature",
        str(args.temperature),
        "--lr",
        str(args.lr),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]
    if framework == "lit_marl":
        return [str(ROOT / ".venv" / "bin" / "python"), __file__, "--worker", *common, "--engine", args.engine] + (
            ["--floor"] if args.floor else []
        )
    python = ROOT / ".venv-comlrl" / "bin" / "python"
    if not python.exists():
        sys.exit("CoMLRL's environment is missing: run scripts/setup_comlrl_venv.sh first")
    return [str(python), str(HERE / "bench_comlrl_worker.py"), *common]


def measure(framework: str, config: dict, args) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(HERE),
    }
    done = subprocess.run(
        worker_command(framework, config, args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout
    )
    if done.returncode != 0:
        return {"error": done.stderr[-600:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_flags(parser, grid=True)
    parser.add_argument("--framework", nargs="+", default=["lit_marl"], choices=["lit_marl", "comlrl"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds; the frameworks alternate within each")
    parser.add_argument("--floor", action="store_true", help="also time the batched floor (lit_marl)")
    parser.add_argument(
        "--engine", default="auto", choices=["auto", "torch", "hf"], help="lit_marl's generation engine (data.engine)"
    )
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or str(workload.default_model_folder())

    if args.worker:  # one configuration, in this process
        for name in ("algorithm", "num_generations", "num_turns", "joint_mode"):
            setattr(
                args, name, getattr(args, name)[0] if isinstance(getattr(args, name), list) else getattr(args, name)
            )
        result = {
            "framework": "lit_marl",
            "algorithm": args.algorithm,
            "num_generations": args.num_generations,
            "num_turns": args.num_turns,
            "joint_mode": args.joint_mode,
            **run_lit_marl(args),
        }
        print(json.dumps(result))
        return

    results = []
    for config in configurations(args):
        runs = {f: [] for f in args.framework}
        for _ in range(args.repeats):
            for framework in args.framework:
                runs[framework].append(measure(framework, config, args))
        row = {**config}
        for framework, measured in runs.items():
            ok = [m for m in measured if "error" not in m]
            if not ok:
                row[framework] = {"error": measured[-1]["error"]}
                continue
            best = min(ok, key=lambda m: m["median_step_s"])
            best["median_step_s_over_repeats"] = statistics.median(m["median_step_s"] for m in ok)
            row[framework] = best
        if all("median_step_s" in row.get(f, {}) for f in ("lit_marl", "comlrl")):
            row["speedup"] = row["comlrl"]["median_step_s_over_repeats"] / row["lit_marl"]["median_step_s_over_repeats"]
        results.append(row)
        print(describe(row), flush=True)
    print(
        json.dumps(
            {
                "model": args.model,
                "engine": args.engine,
                "max_new_tokens": args.max_new_tokens,
                "steps": args.steps,
                "warmup": args.warmup,
                "threads": args.threads,
                "repeats": args.repeats,
                "results": results,
            }
        )
    )


def describe(row: dict) -> str:
    head = f"{row['algorithm']:6s} G={row['num_generations']} T={row['num_turns']} {row['joint_mode']:7s}"
    parts = []
    for framework in ("lit_marl", "comlrl"):
        m = row.get(framework)
        if m is None:
            continue
        if "error" in m:
            parts.append(f"{framework}: ERROR {m['error'][-200:]!r}")
            continue
        text = (
            f"{framework}: {m['median_step_s_over_repeats']:.3f} s/step (min {m['min_step_s']:.3f}), "
            f"{m['generated_tokens_per_step']:.0f} tok, {m['tokens_per_s']:.0f} tok/s, "
            f"gen {m['generate_calls_per_step']:.0f} calls/{m['generate_s']:.3f} s, "
            f"reward {m['reward_calls_per_step']:.0f} calls/{m['reward_transition_s']:.3f} s, "
            f"train {m['train_forward_passes_per_step']:.0f} fwd/{m['optimizer_steps_per_step']:.0f} opt/"
            f"{m['train_s']:.3f} s, rss {m['peak_rss_mb']:.0f} MB"
        )
        if "step_over_floor" in m:
            text += f", floor {m['floor_s']:.3f} s (step/floor {m['step_over_floor']:.2f})"
        parts.append(text)
    if "speedup" in row:
        parts.append(f"speedup {row['speedup']:.1f}x")
    return head + " | " + " | ".join(parts)


if __name__ == "__main__":
    main()
