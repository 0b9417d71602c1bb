"""CoMLRL side of the MAGRPO / IAC / MAAC benchmark: one configuration, trained with CoMLRL 1.4.3's
own trainers on the fixed workload of scripts/bench_workload.py, measured step by step.

    scripts/setup_comlrl_venv.sh        # once: makes .venv-comlrl (CPU torch 2.13.0 + comlrl 1.4.3)
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled .venv-comlrl/bin/python \
        scripts/bench_comlrl_worker.py --algorithm magrpo --num-generations 4 --num-turns 2 --joint-mode cross

One step = one task (CoMLRL's training loop takes one dataset item at a time): its whole joint rollout
(tree for MAGRPO; one trajectory of T turns per agent for IAC/MAAC) plus the parameter updates its
samples trigger. The rollout buffers are sized to exactly one task's samples per agent, so every
step ends with its update (CoMLRL then takes one optimizer step per agent and turn). The trainer
runs unchanged through ``trainer.train()``; the probe only wraps (never alters) the models' generate
and forward, the optimizers' step, the reward and transition functions, and the trainer's per-item
step and buffer-drain methods, to time them. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_workload as workload  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402


class Probe(workload.StepProbe):
    """The shared probe, plus the workload's reward and transition in CoMLRL's calling conventions."""

    def reward_func(self, *agent_completions):
        """CoMLRL passes one list of texts per agent (MAGRPO: one text each, one joint action per
        call; IAC/MAAC: the G texts of each agent) and expects one joint reward per joint action."""
        return [
            workload.joint_reward([agent[j] for agent in agent_completions]) for j in range(len(agent_completions[0]))
        ]

    def transition(
        self, prompt, agent_completions, num_agents, prompt_history_per_agent=None, response_history_per_agent=None
    ):
        """CoMLRL's external transition: the task's original prompt and one joint action -> the
        next prompt of each agent."""
        partners = [[c for k, c in enumerate(agent_completions) if k != i] for i in range(num_agents)]
        return [workload.next_prompt(prompt, agent_completions[i], partners[i]) for i in range(num_agents)]

    def step(self, fn):
        """A trainer method that runs one whole training step."""

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            self.step_begin()
            try:
                return fn(*a, **kw)
            finally:
                self.step_end()

        return wrapper


def chat_formatter(tokenizer):
    """One user message through the model's chat template, generation prompt open (the same
    rendering lit_marl uses); later turns render the transition's prompt the same way."""

    def fmt(item, external_prompts=None):
        text = external_prompts if external_prompts is not None else item["prompt"]
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    return fmt


def nodes_per_tree(g: int, t: int, n: int, joint_mode: str) -> int:
    """MAGRPO tree nodes per agent for one task: every joint action of a node but the last turn's
    opens a child node (aligned: G joint actions per node, cross: G**N)."""
    branching = g**n if joint_mode == "cross" and n > 1 else g
    return sum(branching**k for k in range(t))


def build_trainer(args, probe: Probe):
    from datasets import Dataset
    from transformers import AutoTokenizer

    total = args.warmup + args.steps
    dataset = Dataset.from_list(workload.tasks(total))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    formatter = chat_formatter(tokenizer)
    transition = (
        probe.timed(probe.transition, "reward_transition_s", "transition_calls") if args.num_turns > 1 else None
    )
    reward = probe.timed(probe.reward_func, "reward_transition_s", "reward_calls")
    common = dict(
        agent_learning_rate=args.lr,
        num_agents=args.num_agents,
        num_generations=args.num_generations,
        num_turns=args.num_turns,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,  # pure sampling from the policy (CoMLRL's defaults: top_p 0.6, top_k 50 / None)
        top_k=0,
        discount=1.0,
        early_termination_threshold=None,
        num_train_epochs=1,
        eval_interval=0,
        eval_num_samples=0,
        agent_devices="cpu",
        parallel_training="none",
        logging_steps=1,
    )
    # the workload, the same for every trainer (wandb off)
    workload_args = dict(reward_func=reward, formatters=formatter, external_transition=transition)
    workload_args.update(train_dataset=dataset, wandb_config=None)
    if args.algorithm == "magrpo":
        from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

        buffer = nodes_per_tree(args.num_generations, args.num_turns, args.num_agents, args.joint_mode)
        config = MAGRPOConfig(
            **common,
            joint_mode=args.joint_mode,
            rollout_buffer_size=buffer,
            train_batch_size=buffer,
        )
        trainer = MAGRPOTrainer(agent_model=args.model, num_agents=args.num_agents, args=config, **workload_args)
        critics = []
        step_method, drain_method = "_train_step_returns", "_drain_ready_buffers"
    else:
        from comlrl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer

        buffer = args.num_turns * args.num_generations  # one episode's samples per agent
        common.update(
            critic_learning_rate=args.lr, critic_devices="cpu", rollout_buffer_size=buffer, train_batch_size=buffer
        )
        separate = args.algorithm == "maac" or args.iac_critic == "model"
        if args.algorithm == "iac":
            cls, config = IACTrainer, IACConfig(**common, use_separate_critic=separate)
        else:
            cls, config = MAACTrainer, MAACConfig(**common)
        critic = args.model if separate else None
        trainer = cls(agent_model=args.model, critic_model=critic, args=config, **workload_args)
        critics = [c.model for c in trainer.critics]
        step_method, drain_method = "_run_batch", "_drain_ready_agent_buffers"
    trainer.verbose = False  # no tqdm bar / epoch print (wandb is off: wandb_config=None)
    # IAC/MAAC wrap each causal LM in a CausalLMWithValueHead (the LM is its .model); MAGRPO holds the LMs
    agents = [a.model if type(a).__name__ == "CausalLMWithValueHead" else a for a in trainer.agents]
    assert len({id(m) for m in agents}) == args.num_agents, "each agent must own its model copy"
    pad_id = trainer.tokenizers[0].pad_token_id
    for model in agents + critics:
        probe.wrap_model(model, pad_id)
    setattr(trainer, step_method, probe.step(getattr(trainer, step_method)))
    setattr(trainer, drain_method, probe.timed(getattr(trainer, drain_method), "update_s"))
    info = {
        "comlrl_config": {k: v for k, v in vars(config).items() if not k.startswith("_")},
        "models": {
            "agents": len(agents),
            "critics": len(critics),
            "params_per_agent": sum(p.numel() for p in trainer.agents[0].parameters()),
            "dtype": str(next(agents[0].parameters()).dtype),
        },
    }
    return trainer, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload.add_flags(parser, grid=False)
    parser.add_argument(
        "--iac-critic",
        default="head",
        choices=["head", "model"],
        help="IAC: value head on each actor (use_separate_critic=False, lit_marl's default) "
        "or a separate critic model per agent (use_separate_critic=True, CoMLRL's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.model = args.model or str(workload.default_model_folder())

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    probe = Probe()
    trainer, info = build_trainer(args, probe)
    handle = register_optimizer_step_post_hook(probe.count_optimizer_step)
    start = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - start
    handle.remove()

    if len(probe.steps) != args.warmup + args.steps:
        raise RuntimeError(f"expected {args.warmup + args.steps} steps, saw {len(probe.steps)}")
    result = {
        "framework": "comlrl",
        "algorithm": args.algorithm,
        "num_generations": args.num_generations,
        "num_turns": args.num_turns,
        "joint_mode": args.joint_mode,
        **probe.summary(args.warmup),
        "train_wall_s": train_wall,
        "comlrl_version": __import__("comlrl").__version__,
        "torch_version": torch.__version__,
        "threads": args.threads,
        **info,
    }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
