"""Reference numbers from CoMLRL 1.4.3 itself, for lit_marl's CoMLRL-parity test.

Runs CoMLRL's own trainer code - MAGRPO's tree, returns, advantages, loss and update schedule; IAC's
and MAAC's TD targets, advantage normalization, losses and update schedule - on fixed rewards and
fixed log-probs and values, and prints JSON that ``tests/unit/test_comlrl_parity.py`` pins:

    bash scripts/setup_comlrl_venv.sh
    OMP_NUM_THREADS=1 .venv-comlrl/bin/python scripts/comlrl_parity.py > tests/fixtures/comlrl_1.4.3_parity.json

Only generation (and, for IAC/MAAC, the forwards of the models) is replaced, never the arithmetic:

- MAGRPO: ``_generate_completions_with_external_prompts`` returns two-token completions [t_k, EOS]
  whose text names the tree node, the agent and k. The "model" gives every position of a node's
  prompt the fixed logits ``LOGITS`` (one parameter row per prompt), so a completion's log-prob is
  log_softmax(LOGITS)[t_k] (CoMLRL drops the last token's log-prob: the EOS). CoMLRL's
  ``_compute_loss_with_gradients`` computes the loss; the advantages it used are read back exactly
  from the gradient of the prompt's row, which is -(1/(batch*G)) * (sum_k A_k e_{t_k} - sum_k A_k p)
  with p = softmax(LOGITS). Optimizer steps are counted by a recording optimizer that never moves
  the weights (so the log-probs stay fixed).
- IAC / MAAC: ``_generate_rollout`` / ``_generate`` and the value and log-prob forwards return fixed
  numbers as tensors with gradients; CoMLRL computes the TD targets, the advantages, the losses
  and the steps; each step's losses are read from the backward calls.
"""

from __future__ import annotations

import inspect
import itertools
import json
import random
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from comlrl.trainers.actor_critic import IACTrainer, MAACTrainer
from comlrl.trainers.actor_critic.iac import IACConfig
from comlrl.trainers.actor_critic.maac import MAACConfig
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

V = 8  # vocabulary of the fake model
EOS = V - 1
LOGITS = torch.linspace(-1.0, 1.5, V)  # fixed, not uniform: each token has its own log-prob
LOGP = torch.log_softmax(LOGITS, dim=-1)
P = torch.softmax(LOGITS, dim=-1)


def token_of(agent: int, k: int) -> int:
    return 1 + k + 2 * agent  # distinct per response of a node (agent 0: 1, 2; agent 1: 3, 4)


def reward_of(path: str, ks: tuple[int, ...]) -> float:
    """A fixed joint reward with ties, from the node's path and each agent's response index."""
    return ((3 * ks[0] + 5 * ks[-1] + 2 * len(path) + sum(int(c) for c in path)) % 4) / 2


# --------------------------------------------------------------------------- MAGRPO
class PromptRows(torch.nn.Module):
    """One parameter row of next-token logits per prompt (found by its ids), the same at every position."""

    def __init__(self, rows: int = 64):
        super().__init__()
        self.W = torch.nn.Parameter(LOGITS.repeat(rows, 1).clone())
        self.rows: dict[tuple[int, ...], int] = {}
        self.seen: list[int] = []

    def row(self, prompt_ids: tuple[int, ...]) -> int:
        return self.rows.setdefault(prompt_ids, len(self.rows))

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        key = next(k for k in self.rows if tuple(input_ids[0, : len(k)].tolist()) == k)
        self.seen.append(self.rows[key])
        return SimpleNamespace(logits=self.W[self.rows[key]].expand(1, input_ids.shape[1], V))


class RecordingOptimizer:
    """Counts steps and reads each step's gradients; never changes the weights."""

    def __init__(self, model: PromptRows, log: list, agent: int):
        self.model, self.log, self.agent = model, log, agent

    def zero_grad(self):
        self.model.W.grad = None
        self.model.seen = []

    def step(self):
        rows = sorted(set(self.model.seen))
        self.log.append({"agent": self.agent, "rows": rows, "grad": self.model.W.grad[rows].clone()})


def magrpo_case(joint_mode: str, num_turns: int, mode: str, normalize: bool, per_step: int | None) -> dict:
    G, N = 2, 2
    nodes_per_tree = sum((G ** (N if joint_mode == "cross" else 1)) ** t for t in range(num_turns))
    args = MAGRPOConfig(
        num_agents=N,
        num_generations=G,
        num_turns=num_turns,
        joint_mode=joint_mode,
        early_termination_threshold=None,
        rollout_buffer_size=nodes_per_tree,  # one update per tree
        train_batch_size=per_step,
        advantage_mode=mode,
        advantage_normalization=normalize,
    )
    trainer = MAGRPOTrainer.__new__(MAGRPOTrainer)
    models = [PromptRows() for _ in range(N)]
    steps: list[dict] = []
    prompts: dict[tuple[int, int], str] = {}  # (agent, row) -> the node's path
    nodes: dict[str, dict] = {}
    trainer.args, trainer.num_agents, trainer.advantage_mode = args, N, mode
    trainer.agents = models
    trainer.optimizers = [RecordingOptimizer(m, steps, i) for i, m in enumerate(models)]
    trainer.rollout_buffers = [[] for _ in range(N)]
    trainer.env_step, trainer.wandb_initialized, trainer.parallel_training = 0, False, "none"
    trainer.reward_processor = lambda r: r

    def generate(agent, batch_items, agent_idx=0, num_return_sequences=1, max_new_tokens=0, external_prompts=None):
        prompt = external_prompts if external_prompts is not None else f"{batch_items[0]['prompt']}|"
        path = prompt.split("|", 1)[1]
        ids = (100 + len(prompts), agent_idx)
        prompts[(agent_idx, models[agent_idx].row(ids))] = path
        return {
            "completions": [[f"{path}#{k}" for k in range(num_return_sequences)]],
            "prompts": [prompt],
            "prompt_input_ids": torch.tensor([ids]),
            "completion_input_ids": [[torch.tensor([token_of(agent_idx, k), EOS]) for k in range(G)]],
            "reference_kls": [],
        }

    def reward_func(*completions):
        texts = [c[0] for c in completions]
        path = texts[0].split("#")[0]
        reward = reward_of(path, tuple(int(t.split("#")[1]) for t in texts))
        nodes.setdefault(path, {"path": path, "rewards": []})["rewards"].append(reward)
        return [reward]

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        path = prompt_history_per_agent[0][-1].split("|", 1)[1]
        ks = [int(c.split("#")[1]) for c in agent_completions]
        j = ks[0] * G + ks[1] if joint_mode == "cross" else ks[0]
        return [f"{prompt}|{path}{j}"] * num_agents

    trainer._generate_completions_with_external_prompts = generate
    trainer.reward_func, trainer.external_transition = reward_func, transition
    losses: list[float] = []
    compute = trainer._compute_loss_with_gradients

    def recording_loss(agent, completions_data, returns):
        loss = compute(agent, completions_data, returns)
        losses.append(float(loss.detach()))
        return loss

    trainer._compute_loss_with_gradients = recording_loss
    random.seed(0)
    tasks, updates = [], []
    for task in range(2):
        nodes.clear()
        steps.clear()
        losses.clear()
        trainer._train_step_returns({"prompt": f"task{task}"})
        tasks.append(sorted(nodes.values(), key=lambda n: (len(n["path"]), n["path"])))
        # the samples each step used, in order, with the advantages read from the gradients
        cursor = 0
        for step in steps:
            batch = len(step["rows"])
            scale = 1.0 / (batch * G)
            entries = []
            for row, grad in zip(step["rows"], step["grad"]):
                total = float(grad[EOS]) / (scale * float(P[EOS]))  # sum_k A_k (EOS is no target)
                agent = step["agent"]
                advantages = [
                    (scale * total * float(P[token_of(agent, k)]) - float(grad[token_of(agent, k)])) / scale
                    for k in range(G)
                ]
                entries.append({"path": prompts[(agent, row)], "advantages": advantages})
            step_losses = losses[cursor : cursor + batch]
            cursor += batch
            updates.append(
                {
                    "task": task,
                    "agent": step["agent"],
                    "turn": len(entries[0]["path"]),
                    "nodes": entries,
                    "loss": sum(step_losses) / batch,
                }
            )
    return {
        "joint_mode": joint_mode,
        "num_turns": num_turns,
        "advantage_mode": mode,
        "advantage_normalization": normalize,
        "train_batch_size": per_step,
        "tasks": tasks,
        "steps": updates,
    }


# --------------------------------------------------------------------------- IAC / MAAC
def ac_reward(task: int, turn: int, agent: int) -> float:
    return ((3 * task + 5 * turn + 2 * agent) % 5) / 4


def ac_logprob(task: int, turn: int, agent: int) -> float:
    return -(1.0 + 0.3 * agent + 0.2 * turn + 0.1 * task)


def ac_value(task: int, turn: int, agent: int | None) -> float:
    """V(h) of an agent's turn (IAC); ``agent=None``: the centralized critic's V of the joint state."""
    return 0.1 * (task + 1) - 0.2 * turn + (0.0 if agent is None else 0.05 * agent)


class Offsets(torch.nn.Module):
    """A parameter per row (0): fixed numbers + offset, so a loss's gradient reads out its coefficients."""

    def __init__(self, rows: int = 256):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(rows))


class StepLog:
    """Recording optimizers: each step, the rows its loss read (``pending``, filled by the fake
    forwards of the step's mini-batch) and their gradients."""

    def __init__(self, module: Offsets, log: list, kind: str, agent: int, pending: dict):
        self.module, self.log, self.kind, self.agent, self.pending = module, log, kind, agent, pending

    def zero_grad(self):
        self.module.offset.grad = None

    def step(self):
        grad = self.module.offset.grad
        rows, self.pending[self.kind] = self.pending[self.kind], []
        loss = self.pending.pop("loss")  # the backward just before this step: its loss
        self.log.append(
            {"kind": self.kind, "agent": self.agent, "loss": loss, "grad": {r: float(grad[r]) for r in rows}}
        )


def ac_case(algorithm: str, num_turns: int, tasks_per_update: int, per_step: int | None) -> dict:
    N, gamma, coef = 2, 0.9, 0.6
    config = IACConfig if algorithm == "iac" else MAACConfig
    trainer_cls = IACTrainer if algorithm == "iac" else MAACTrainer
    args = config(
        num_agents=N,
        num_turns=num_turns,
        rollout_buffer_size=tasks_per_update * num_turns,  # rows per agent: one update per tasks_per_update tasks
        train_batch_size=per_step,
        early_termination_threshold=None,
        discount=gamma,
        value_loss_coef=coef,
    )
    trainer = trainer_cls.__new__(trainer_cls)
    actors, critic = [Offsets() for _ in range(N)], Offsets()
    rows: dict[tuple, int] = {}  # (task, turn, agent) -> row of its sequence; (task, turn, None): the joint state
    log: list[dict] = []
    pending: dict[str, list[int]] = {"actor": [], "critic": []}
    trainer.args, trainer.critic_type, trainer.env_step = args, "v", 0
    trainer.agents = actors
    trainer.agent_devices = [torch.device("cpu")] * N
    trainer.agent_optimizers = [StepLog(a, log, "actor", i, pending) for i, a in enumerate(actors)]
    if algorithm == "iac":
        trainer.critics = [critic] * N  # one Offsets module: rows tell the agents apart
        trainer.critic_optimizers = [StepLog(critic, log, "critic", i, pending) for i in range(N)]
        trainer._critic_device = lambda agent_idx: torch.device("cpu")
    else:
        trainer.critics = [critic]
        trainer.critic_optimizer = StepLog(critic, log, "critic", -1, pending)
        trainer.critic_device = torch.device("cpu")
    trainer.rollout_buffers = [[] for _ in range(N)]
    trainer.reward_processor = lambda r: r
    trainer._log_domain_metrics = lambda *a, **k: None
    trainer._should_log_train = lambda: False
    trainer.parallel_training = "none"
    trainer.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "completion")
    current = {"task": 0}

    def formatter(item, agent_idx, external_prompts=None):
        return f"t{item['task']}|0" if external_prompts is None else external_prompts

    trainer._format_prompt = lambda item, agent_idx, external_prompts=None: formatter(item, agent_idx, external_prompts)

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        turn = len(prompt_history_per_agent[0])
        return [f"t{current['task']}|{turn}"] * num_agents

    def reward(c0, c1):
        turn = int(c0[0].split("|")[1])
        return [ac_reward(current["task"], turn, a) for a in range(N)]

    trainer.external_transition, trainer.reward_func = transition, reward
    trainer._reward_signature = inspect.signature(reward)

    def row(key):
        return rows.setdefault(key, len(rows))

    def sequence(prompt: str, agent: int):
        turn = int(prompt.split("|")[1])
        r = row((current["task"], turn, agent))
        return turn, torch.tensor([[r, 0]]), r

    def generate_iac(agent_model, prompt, agent_idx, num_ret):
        turn, seq, r = sequence(prompt, agent_idx)
        return {
            "prompt": prompt,
            "prompt_len": 1,
            "sequences": seq,
            "attention_mask": torch.ones_like(seq),
            "response_lens": [1],
            "logprobs": [torch.tensor(ac_logprob(current["task"], turn, agent_idx))],
            "reference_kls": [],
            "values": torch.tensor([ac_value(current["task"], turn, agent_idx)]),
            "completions": [f"{prompt}"],
        }

    def generate_maac(agent_model, prompt, agent_idx):
        out = generate_iac(agent_model, prompt, agent_idx, 1)
        return {k: out[k] for k in ("prompt", "prompt_len", "sequences", "attention_mask", "response_lens")} | {
            "reference_kls": [],
            "completions": out["completions"],
        }

    def policy_eval(agent_model, sequences, attention_mask, prompt_len, response_len, output_values=False, **kw):
        task, turn, agent = next(k for k, v in rows.items() if v == int(sequences[0, 0]))
        pending["actor"].append(int(sequences[0, 0]))
        return torch.tensor([ac_logprob(task, turn, agent)]) + agent_model.offset[int(sequences[0, 0])], None

    def value_iac(model, sequences, attention_mask, prompt_len, response_lens):
        task, turn, agent = next(k for k, v in rows.items() if v == int(sequences[0, 0]))
        pending["critic"].append(int(sequences[0, 0]))
        return torch.tensor([ac_value(task, turn, agent)]) + model.offset[int(sequences[0, 0])]

    def critic_value_from_text(critic_input):
        turn = int(critic_input.split("|")[1][0])
        r = row((current["task"], turn, None))
        ids = torch.tensor([[r]])
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "prompt_len": 1,
            "value": torch.tensor([ac_value(current["task"], turn, None)]),
        }

    def value_maac(model, ids, mask, prompt_len):
        task, turn, _ = next(k for k, v in rows.items() if v == int(ids[0, 0]))
        pending["critic"].append(int(ids[0, 0]))
        return torch.tensor([ac_value(task, turn, None)]) + model.offset[int(ids[0, 0])]

    trainer._policy_eval = policy_eval
    ac_step = trainer._ac_step

    def fresh_step(agent_idx, batch):  # forwards at collection time are not a step's
        pending["actor"], pending["critic"] = [], []
        return ac_step(agent_idx, batch)

    trainer._ac_step = fresh_step
    if algorithm == "iac":
        trainer._generate_rollout, trainer._value_for_critic_type = generate_iac, value_iac
    else:
        trainer._generate, trainer._critic_value_from_text = generate_maac, critic_value_from_text
        trainer._value_on_prompt_only = value_maac
    backward = torch.Tensor.backward

    def recording_backward(loss, *args, **kwargs):  # each step's loss as CoMLRL computed it
        pending["loss"] = float(loss.detach())
        return backward(loss, *args, **kwargs)

    torch.Tensor.backward = recording_backward
    random.seed(0)
    for task in range(2 * tasks_per_update):  # two updates
        current["task"] = task
        trainer._run_batch([{"task": task, "prompt": f"task {task}"}], defaultdict(list))
        for entry in log:
            entry.setdefault("update", task // tasks_per_update)
    torch.Tensor.backward = backward
    # each step: its kind, agent, and per row the coefficient of its offset in the step's loss
    steps = []
    for entry in log:
        batch = len(entry["grad"])
        out = []
        for r, g in entry["grad"].items():
            task, turn, agent = next(k for k, v in rows.items() if v == r)
            if entry["kind"] == "actor":  # loss = mean(-(S + offset) * A): dL/d offset = -A / batch
                out.append({"task": task, "turn": turn, "advantage": -g * batch})
            else:  # loss = coef * mean((y - V - offset)^2): dL/d offset = -2 coef (y - V) / batch
                out.append({"task": task, "turn": turn, "target": ac_value(task, turn, agent) - g * batch / (2 * coef)})
        steps.append(
            {
                "kind": entry["kind"],
                "agent": entry["agent"],
                "update": entry["update"],
                "loss": entry["loss"],
                "rows": out,
            }
        )
    return {
        "algorithm": algorithm,
        "num_turns": num_turns,
        "tasks_per_update": tasks_per_update,
        "train_batch_size": per_step,
        "discount": gamma,
        "value_loss_coef": coef,
        "logprobs": "S(task, turn, agent) = -(1 + 0.3 agent + 0.2 turn + 0.1 task)",
        # the fixed numbers CoMLRL was fed: each agent's reward, log-prob, V of its turn; V of the joint state
        "inputs": [
            {
                "task": task,
                "turn": turn,
                "rewards": [ac_reward(task, turn, a) for a in range(N)],
                "logprobs": [ac_logprob(task, turn, a) for a in range(N)],
                "values": [ac_value(task, turn, a) for a in range(N)],
                "joint_value": ac_value(task, turn, None),
            }
            for task in range(2 * tasks_per_update)
            for turn in range(num_turns)
        ],
        "steps": steps,
    }


def main() -> None:
    torch.manual_seed(0)
    out = {
        "command": "OMP_NUM_THREADS=1 .venv-comlrl/bin/python scripts/comlrl_parity.py",
        "comlrl": "1.4.3",
        "logits": LOGITS.tolist(),
        "eos": EOS,
        "actor_critic": [
            ac_case(algorithm, num_turns, tasks, per_step)
            for algorithm, num_turns, tasks, per_step in itertools.product(["iac", "maac"], [1, 2], [1, 3], [None, 1])
        ],
        "magrpo": [
            magrpo_case(joint_mode, num_turns, mode, normalize, per_step)
            for joint_mode, num_turns, mode, normalize, per_step in itertools.product(
                ["aligned", "cross"], [1, 2], ["mean", "raw", "max", "rloo"], [True, False], [None, 1]
            )
        ],
    }
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
