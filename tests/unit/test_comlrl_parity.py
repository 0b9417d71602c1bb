"""CoMLRL parity: with the presets of configs/comlrl/, lit_marl's advantages, losses and optimizer
steps per update equal CoMLRL 1.4.3's own, computed by CoMLRL's code on fixed rewards, log-probs
and values and pinned in tests/fixtures/comlrl_1.4.3_parity.json by

    bash scripts/setup_comlrl_venv.sh
    OMP_NUM_THREADS=1 .venv-comlrl/bin/python scripts/comlrl_parity.py > tests/fixtures/comlrl_1.4.3_parity.json

(see that script for how the numbers are read out of CoMLRL's trainers)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lit_marl.algorithms import IAC, MAAC, MAGRPO
from lit_marl.returns import per_response, tree_returns
from lit_marl.rollout.batch import AgentSamples

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "comlrl_1.4.3_parity.json").read_text())
G, N = 2, 2


def preset(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / "comlrl" / f"{name}.yaml").read_text())


def case_id(case: dict) -> str:
    norm = "norm" if case["advantage_normalization"] else "raw-scale"
    return f"{case['joint_mode']}-T{case['num_turns']}-{case['advantage_mode']}-{norm}-batch{case['train_batch_size']}"


def token_of(agent: int, k: int) -> int:
    return 1 + k + 2 * agent  # as scripts/comlrl_parity.py


def tree_of(nodes: list[dict], joint_mode: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[str]]]:
    """CoMLRL's tree (nodes named by their path of joint-action indices) as lit_marl's levels:
    rewards ``[nodes, J, agents]`` and each joint action's child, breadth-first."""
    J = G**N if joint_mode == "cross" else G
    levels: list[list[str]] = []
    for node in nodes:
        depth = len(node["path"])
        levels += [[] for _ in range(depth + 1 - len(levels))]
        levels[depth].append(node["path"])
    by_path = {node["path"]: node for node in nodes}
    rewards, children = [], []
    for depth, paths in enumerate(levels):
        below = {p: n for n, p in enumerate(levels[depth + 1])} if depth + 1 < len(levels) else {}
        joint = torch.tensor([by_path[p]["rewards"] for p in paths])
        rewards.append(joint.unsqueeze(2).expand(-1, -1, N))  # a joint reward is every agent's
        children.append(torch.tensor([[below.get(p + str(j), -1) for j in range(J)] for p in paths]))
    return rewards, children, levels


class Recorder:
    """Stands in for the optimizer step of a module's update: runs the step's own loss function on
    its rows (the module's real loss code) and records it; weights, hence log-probs, stay fixed."""

    def __init__(self, module):
        self.module, self.steps = module, []

    def __call__(self, kind, name, rows, loss_fn, count):
        count = float(count if count is not None else (0 if rows is None else len(rows)))
        loss = 0.0 if rows is None or count == 0 else float(loss_fn(rows)) / count
        turns = sorted({int(t) for t in rows.turn_ids}) if rows is not None else []
        self.steps.append({"kind": kind, "name": name, "turns": turns, "loss": loss, "rows": rows})
        return loss


def fake_team(num_agents: int) -> list[SimpleNamespace]:
    """Separate agents (one learner each) that no test here runs: forwards are replaced."""
    return [SimpleNamespace(pad_token_id=0, model=None) for _ in range(num_agents)]


@pytest.mark.parametrize("case", REFERENCE["magrpo"], ids=case_id)
def test_magrpo_preset_reproduces_comlrl(case, monkeypatch):
    """lit_marl's MAGRPO update (flush_buffers: buffers, advantages, per-turn mini-batches, the
    zero-advantage skip, loss) on CoMLRL's tree gives CoMLRL's advantages, per-step losses
    and optimizer steps per update and turn."""
    settings = preset("magrpo")
    data = settings["data"]["init_args"]
    given = settings["model"]["init_args"]
    module = MAGRPO(
        **{
            **given,
            "num_agents": N,
            "advantage": {
                **given.get("advantage", {}),
                "mode": case["advantage_mode"],
                "normalization": case["advantage_normalization"],
            },
            # CoMLRL's null is the buffer size (here a whole tree): one step per turn
            "update": {**given.get("update", {}), "train_batch_size": case["train_batch_size"]},
        }
    )
    module.agents = fake_team(N)
    module.log = lambda *args, **kwargs: None
    recorder = Recorder(module)
    monkeypatch.setattr(
        module,
        "update_agent",
        lambda index, rows, loss_fn, count=None, **kw: recorder("actor", index, rows, loss_fn, count),
    )
    logp = torch.log_softmax(torch.tensor(REFERENCE["logits"]), dim=-1)
    eos = REFERENCE["eos"]

    def fixed_logits(model, input_ids, attention_mask, num_completion, prompt_groups=None):
        """Logits that give each completion token its fixed log-prob (``logp``), and the EOS 0 (a
        certain EOS), as CoMLRL leaves the last token out of its loss (a documented difference)."""
        tokens = input_ids[:, -num_completion:]
        logits = logp.expand(*tokens.shape, len(logp)).clone()
        logits[tokens == eos] = torch.where(torch.arange(len(logp)) == eos, 0.0, -1e9)
        return logits

    monkeypatch.setattr("lit_marl.algorithms.magrpo.completion_logits", fixed_logits)
    for task, nodes in enumerate(case["tasks"]):
        rewards, children, levels = tree_of(nodes, case["joint_mode"])
        returns = tree_returns(rewards, children, settings["model"]["init_args"]["discount"])
        per_level = [per_response(r, case["joint_mode"], G, data["cross_return"]) for r in returns]
        paths = [path for level in levels for path in level]
        counts = [len(level) for level in levels]
        turn_ids = torch.cat([torch.full((c * G,), t) for t, c in enumerate(counts)])
        group_ids = torch.arange(len(paths)).repeat_interleave(G)
        per_agent = []
        for agent in range(N):
            completion = torch.tensor([[token_of(agent, k), eos] for _ in paths for k in range(G)])
            samples = AgentSamples(
                input_ids=torch.cat([torch.full((len(completion), 1), 100 + agent), completion], dim=1),
                attention_mask=torch.ones(len(completion), 3, dtype=torch.long),
                completion_mask=torch.ones(len(completion), 2, dtype=torch.long),
                returns=torch.cat([level[agent].reshape(-1) for level in per_level]),
                group_ids=group_ids,
                turn_ids=turn_ids,
            )
            per_agent.append(module.advantages(samples))
        recorder.steps.clear()
        module.rollout_buffers[0].add(per_agent[0])
        module.rollout_buffers[1].add(per_agent[1])
        module.flush_buffers()
        expected = [s for s in case["steps"] if s["task"] == task]
        for agent in range(N):
            advantages = per_agent[agent].advantages.view(-1, G)
            theirs = [s for s in expected if s["agent"] == agent]
            for step in theirs:  # the advantage of every response of every node CoMLRL trained on
                for node in step["nodes"]:
                    got = advantages[paths.index(node["path"])]
                    torch.testing.assert_close(got, torch.tensor(node["advantages"]), atol=2e-5, rtol=1e-5)
            ours = [s for s in recorder.steps if s["name"] == agent]
            assert len(ours) == len(theirs)  # the same optimizer steps
            for mine, ref in zip(ours, theirs):  # per turn, in turn order
                if mine["rows"] is None:  # every advantage 0: its rows were skipped, the step still taken
                    assert all(a == pytest.approx(0.0, abs=2e-5) for n in ref["nodes"] for a in n["advantages"])
                    mine["turns"] = [ref["turn"]]
                assert mine["turns"] == [ref["turn"]]
            for turn in {s["turn"] for s in theirs}:  # inside a turn, each library's own shuffle
                mine = sorted(s["loss"] for s in ours if s["turns"] == [turn])
                assert mine == pytest.approx(sorted(s["loss"] for s in theirs if s["turn"] == turn), abs=1e-5)


def test_under_comlrls_normalization_every_advantage_mode_is_the_same():
    """A finding the parity makes visible: CoMLRL's z-score re-centres, so with normalization on
    (its default) mean, raw, max and rloo give identical advantages."""
    normalized = defaultdict(list)
    for case in REFERENCE["magrpo"]:
        if case["advantage_normalization"] and case["train_batch_size"] is None:
            key = (case["joint_mode"], case["num_turns"])
            normalized[key].append([a for s in case["steps"] for n in s["nodes"] for a in n["advantages"]])
    for key, runs in normalized.items():
        assert len(runs) == 4
        for run in runs[1:]:
            assert run == pytest.approx(runs[0], abs=2e-5), key


# --------------------------------------------------------------------------- IAC / MAAC
def ac_case_id(case: dict) -> str:
    return f"{case['algorithm']}-T{case['num_turns']}-tasks{case['tasks_per_update']}-batch{case['train_batch_size']}"


def ac_rows(case: dict, update: int) -> list[AgentSamples]:
    """One update's rows per agent, as a tree lists them (turn-major, task-minor; one node per row),
    each a one-token prompt and a two-token response. The prompt token names the row:
    1000 + 100 * agent + 10 * task + turn."""
    T, k = case["num_turns"], case["tasks_per_update"]
    inputs = {(row["task"], row["turn"]): row for row in case["inputs"]}
    order = [(task, turn) for turn in range(T) for task in range(update * k, (update + 1) * k)]
    node = {key: n for n, key in enumerate(order)}
    out = []
    for agent in range(N):
        prompts = torch.tensor([[1000 + 100 * agent + 10 * task + turn] for task, turn in order])
        out.append(
            AgentSamples(
                input_ids=torch.cat([prompts, torch.full((len(order), 2), 7)], dim=1),
                attention_mask=torch.ones(len(order), 3, dtype=torch.long),
                completion_mask=torch.ones(len(order), 2, dtype=torch.long),
                returns=torch.zeros(len(order)),
                group_ids=torch.arange(len(order)),
                turn_ids=torch.tensor([turn for _, turn in order]),
                rewards=torch.tensor([inputs[key]["rewards"][agent] for key in order]),
                next_group=torch.tensor([node.get((task, turn + 1), -1) for task, turn in order]),
            )
        )
    return out


@pytest.mark.parametrize("case", REFERENCE["actor_critic"], ids=ac_case_id)
def test_actor_critic_preset_reproduces_comlrl(case, monkeypatch):
    """lit_marl's IAC/MAAC update (ActorCritic.update: TD targets, advantages z-scored per agent
    and turn with a lone row kept, per-turn mini-batches, loss, critic_loss with the preset's
    value_loss_coef, MAAC's per-agent targets and critic steps) on fixed rewards, log-probs and
    values gives CoMLRL's advantages, targets and losses, step by step, per update."""
    settings = preset(case["algorithm"])
    algorithm = IAC if case["algorithm"] == "iac" else MAAC
    given = settings["model"]["init_args"]
    update = {**given.get("update", {}), "train_batch_size": case["train_batch_size"]}
    module = algorithm(**{**given, "update": update, "num_agents": 2})
    module.agents, module.discount = fake_team(N), case["discount"]
    module.log = lambda *args, **kwargs: None
    inputs = {(row["task"], row["turn"]): row for row in case["inputs"]}

    def decode(token: int) -> tuple[int, int, int]:  # (agent, task, turn) of a row's prompt token
        return (token - 1000) // 100, (token % 100) // 10, token % 10

    def actor_forward(learner, samples, entropy=False):
        logprobs = [inputs[decode(int(t))[1:]]["logprobs"][decode(int(t))[0]] for t in samples.input_ids[:, 0]]
        # two tokens, each half the response's log-prob: CoMLRL's sum is the response's, a mean would not be
        return torch.tensor(logprobs).unsqueeze(1).expand(-1, 2) / 2, None, None

    def critic_values(rows):  # V of an agent's turn (IAC), of the joint state (MAAC: agent 0's token leads)
        agent, task, turn = zip(*(decode(int(t)) for t in rows.input_ids[:, 0]))
        if module.centralized:
            return torch.tensor([inputs[(k, t)]["joint_value"] for k, t in zip(task, turn)])
        return torch.tensor([inputs[(k, t)]["values"][a] for a, k, t in zip(agent, task, turn)])

    module.critics = [critic_values] * (1 if module.centralized else N)
    monkeypatch.setattr(module, "actor_forward", actor_forward)
    monkeypatch.setattr(module, "critic_model", lambda entry: critic_values)
    recorder = Recorder(module)
    monkeypatch.setattr(
        module,
        "update_agent",
        lambda index, rows, loss_fn, count=None, **kw: recorder("actor", index, rows, loss_fn, count),
    )
    monkeypatch.setattr(
        module,
        "optimizer_step_on",
        lambda optimizer, rows, loss_fn, name, count=None, *a, **kw: recorder("critic", name, rows, loss_fn, count),
    )
    monkeypatch.setattr(module, "critic_optimizer", lambda critic: None)

    def numbers(step, kind):
        """A step's rows as (task, turn, its advantage or TD target), sorted."""
        rows = step["rows"]
        values = rows.advantages if kind == "actor" else rows.targets
        keys = [decode(int(t))[1:] for t in rows.input_ids[:, 0]]
        return sorted((k[0], k[1], round(float(v), 4)) for k, v in zip(keys, values))

    for update in range(2):
        recorder.steps.clear()
        module.train_on(ac_rows(case, update))
        theirs = [s for s in case["steps"] if s["update"] == update]
        for kind in ("actor", "critic"):
            names = sorted({s["agent"] for s in theirs if s["kind"] == kind})
            ours_names = sorted({s["name"] for s in recorder.steps if s["kind"] == kind})
            # CoMLRL's critic steps: one per agent (IAC) or the one critic's (-1, MAAC)
            assert len(ours_names) == len(names), kind
            for ours_name, name in zip(ours_names, names):
                ours = [s for s in recorder.steps if s["kind"] == kind and s["name"] == ours_name]
                ref = [s for s in theirs if s["kind"] == kind and s["agent"] == name]
                assert len(ours) == len(ref), (kind, name)  # the same optimizer steps
                expected = sorted(
                    (
                        sorted(
                            (r["task"], r["turn"], round(r["advantage" if kind == "actor" else "target"], 4))
                            for r in s["rows"]
                        ),
                        round(s["loss"], 4),
                    )
                    for s in ref
                )
                got = sorted((numbers(s, kind), round(s["loss"], 4)) for s in ours)
                assert got == expected, (kind, name)


@pytest.mark.parametrize("name, algorithm", [("magrpo", MAGRPO), ("iac", IAC), ("maac", MAAC)])
def test_preset_optimizers_are_comlrls(name, algorithm):
    """AdamW with torch's default weight decay 0.01 on every optimizer, no gradient clipping."""
    module = algorithm(model="tiny-random", num_agents=2, **preset(name)["model"]["init_args"])
    module.configure_model()
    optimizers = module.configure_optimizers()
    assert all(group["weight_decay"] == 0.01 for o in optimizers for group in o.param_groups)
    assert module.hparams.max_grad_norm == 0.0
