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
from lit_marl.losses import masked_sum, reinforce
from lit_marl.returns import next_turn_rows, per_response, td_targets, tree_returns
from lit_marl.rollout.buffer import minibatches

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


@pytest.mark.parametrize("case", REFERENCE["magrpo"], ids=case_id)
def test_magrpo_preset_reproduces_comlrl(case):
    settings = preset("magrpo")
    data = settings["data"]["init_args"]
    module = MAGRPO(
        **{
            **settings["model"]["init_args"],
            "advantage_mode": case["advantage_mode"],
            "advantage_normalization": case["advantage_normalization"],
            # CoMLRL's null is the buffer size (here a whole tree): one step per turn
            "train_batch_size": case["train_batch_size"],
        }
    )
    logp = torch.log_softmax(torch.tensor(REFERENCE["logits"]), dim=-1)
    for task, nodes in enumerate(case["tasks"]):
        rewards, children, levels = tree_of(nodes, case["joint_mode"])
        returns = tree_returns(rewards, children, data["discount"])
        per_level = [per_response(r, case["joint_mode"], G, data["cross_return"]) for r in returns]
        expected = [s for s in case["steps"] if s["task"] == task]
        for agent in range(N):
            flat = torch.cat([level[agent].reshape(-1) for level in per_level])
            counts = [len(paths) for paths in levels]
            samples = SimpleNamespace(
                returns=flat,
                group_ids=torch.arange(sum(counts)).repeat_interleave(G),
                turn_ids=torch.cat([torch.full((c * G,), t) for t, c in enumerate(counts)]),
            )
            advantages = module.advantages(samples).view(-1, G)
            row_of = {p: n for n, p in enumerate(path for paths in levels for path in paths)}
            ours_steps = defaultdict(list)
            # the sequence log-prob of response k: its token's; the EOS log-prob is 0 here because
            # CoMLRL leaves the last token out of the loss (a documented difference)
            token_logprobs = torch.stack(
                [logp[torch.tensor([token_of(agent, k) for k in range(G)])], torch.zeros(G)], 1
            )
            seq = masked_sum(token_logprobs, torch.ones(G, 2), module.logprob_reduction)
            for rows in minibatches(samples, module.train_batch_size, torch.Generator(), module.update_schedule):
                nodes_in = torch.unique(samples.group_ids[rows])
                loss = reinforce(seq.repeat(len(nodes_in)), advantages[nodes_in].reshape(-1)).sum() / len(rows)
                ours_steps[int(samples.turn_ids[rows[0]])].append(float(loss))
            theirs = [s for s in expected if s["agent"] == agent]
            for step in theirs:
                for node in step["nodes"]:
                    torch.testing.assert_close(
                        advantages[row_of[node["path"]]], torch.tensor(node["advantages"]), atol=2e-5, rtol=1e-5
                    )
            theirs_by_turn = defaultdict(list)
            for step in theirs:
                theirs_by_turn[step["turn"]].append(step["loss"])
            # the same optimizer steps per turn and update, with the same losses (the order of
            # steps inside a turn is each library's own shuffle)
            assert {t: len(v) for t, v in ours_steps.items()} == {t: len(v) for t, v in theirs_by_turn.items()}
            for turn, losses in theirs_by_turn.items():
                assert sorted(ours_steps[turn]) == pytest.approx(sorted(losses), abs=1e-5)
            if module.update_schedule == "per_turn":  # turn by turn, as CoMLRL
                assert [s["turn"] for s in theirs] == sorted(s["turn"] for s in theirs)


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


@pytest.mark.parametrize("case", REFERENCE["actor_critic"], ids=ac_case_id)
def test_actor_critic_preset_reproduces_comlrl(case):
    """TD targets, advantages (z-scored per agent and turn; a lone row keeps its own) and the
    optimizer steps of every update, actor and critic, per agent and turn."""
    settings = preset(case["algorithm"])
    algorithm = IAC if case["algorithm"] == "iac" else MAAC
    module = algorithm(**{**settings["model"]["init_args"], "train_batch_size": case["train_batch_size"]})
    T, k = case["num_turns"], case["tasks_per_update"]
    by_key = {(row["task"], row["turn"]): row for row in case["inputs"]}
    theirs = defaultdict(list)  # (kind, agent, turn) -> per step, the sorted numbers of its rows
    for step in case["steps"]:
        agents = range(N) if step["agent"] < 0 else [step["agent"]]
        key = "advantage" if step["kind"] == "actor" else "target"
        turns = {row["turn"] for row in step["rows"]}
        assert len(turns) == 1  # CoMLRL: a step holds one turn
        for agent in agents if step["kind"] == "actor" else [step["agent"]]:
            theirs[(step["kind"], agent, turns.pop() if turns else None)].append(sorted(r[key] for r in step["rows"]))
    ours = defaultdict(list)
    for update in range(2):
        tasks = range(update * k, (update + 1) * k)
        # rows turn-major, task-minor, as a tree lists them; node id = row (one row per node)
        order = [(task, turn) for turn in range(T) for task in tasks]
        node = {key: n for n, key in enumerate(order)}
        group_ids = torch.arange(len(order))
        next_group = torch.tensor([node.get((task, turn + 1), -1) for task, turn in order])
        turns = torch.tensor([turn for _, turn in order])
        next_rows = next_turn_rows(group_ids, next_group)
        joint = torch.tensor([by_key[key]["joint_value"] for key in order])
        targets, advantages = [], []
        for agent in range(N):
            rewards = torch.tensor([by_key[key]["rewards"][agent] for key in order])
            values = joint if module.centralized else torch.tensor([by_key[key]["values"][agent] for key in order])
            if module.centralized and module.critic_reward == "team":
                rewards = torch.tensor([sum(by_key[key]["rewards"]) / N for key in order])
            y = td_targets(rewards, values, next_rows, case["discount"])
            targets.append(y)
            advantages.append(module.advantages(y, values, turns))
        samples = SimpleNamespace(group_ids=group_ids, turn_ids=turns)  # per_turn reads only these
        critic_entries = len(module.critic_roles()) if module.centralized else N
        for rows in minibatches(samples, module.train_batch_size, torch.Generator(), module.update_schedule):
            turn = int(turns[rows[0]])
            for agent in range(N):
                ours[("actor", agent, turn)].append(sorted(advantages[agent][rows].tolist()))
            for entry in range(critic_entries):  # MAAC per_agent: the one critic once per agent's targets
                agent = entry if (not module.centralized or module.critic_updates == "per_agent") else 0
                name = -1 if module.centralized else agent
                ours[("critic", name, turn)].append(sorted(targets[agent][rows].tolist()))
    assert {key: len(v) for key, v in ours.items()} == {key: len(v) for key, v in theirs.items()}
    for key, steps in theirs.items():

        def rounded(step):
            return [round(x, 4) for x in step]

        mine, reference = sorted(ours[key], key=rounded), sorted(steps, key=rounded)
        assert [len(s) for s in mine] == [len(s) for s in reference], key
        assert [x for s in mine for x in s] == pytest.approx([x for s in reference for x in s], abs=1e-5), key


@pytest.mark.parametrize("name, algorithm", [("magrpo", MAGRPO), ("iac", IAC), ("maac", MAAC)])
def test_preset_optimizers_are_comlrls(name, algorithm):
    """AdamW with torch's default weight decay 0.01 on every optimizer, no gradient clipping."""
    module = algorithm(model="tiny-random", num_agents=2, **preset(name)["model"]["init_args"])
    module.configure_model()
    optimizers = module.configure_optimizers()
    assert all(group["weight_decay"] == 0.01 for o in optimizers for group in o.param_groups)
    assert module.hparams.max_grad_norm == 0.0
