"""Joint rollout tree, built breadth-first over turns.

At every open node each agent samples G responses; joint actions pair them (``aligned``: by
index, G per node, G^T leaves after T turns; ``cross``: Cartesian product, G^N per node,
G^(N*T) leaves). Per turn: ONE batched generate per agent over all open nodes of all tasks, ONE
reward call over all their joint actions. Each joint action of a non-terminal node opens a child
node whose prompts the environment's transition builds from that branch's own histories.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from lit_marl.agents import Agent, give_tools, roles_by_model
from lit_marl.envs.base import Env
from lit_marl.envs.processors import RewardProcessor
from lit_marl.generation import Engine, Generation, make_engine
from lit_marl.generation.base import Sampling, prefill_counts, prefill_stats, stream_seed
from lit_marl.metrics import markdown_line
from lit_marl.returns import CrossReduce, JointMode, joint_indices, neutral_fill
from lit_marl.rollout.batch import AgentSamples, RolloutBatch, TreeLevels
from lit_marl.rollout.tree_tools import TreeTools, team_block, tool_rounds, turn_counts


@dataclass(frozen=True)
class TreeSettings:
    """How a tree grows; the data module builds one from its settings (``RolloutDataModule``
    documents each field)."""

    num_generations: int = 1
    joint_mode: JointMode = "aligned"
    num_turns: int = 1
    sampling: Sampling = Sampling()
    early_termination_threshold: float | None = None
    chat_template: bool = True
    cross_return: CrossReduce = "mean"
    reward_processor: RewardProcessor = RewardProcessor()
    # None: samples draw from torch's generator; an int: every response its own stream, seeded by it,
    # the task, the tree node, the role and the sample index (``data.sampling_streams: per_task``)
    sampling_seed: int | None = None
    tools: TreeTools | None = None  # ``data.tools``: tool rounds within each agent's turn (``tree_tools.py``)


@dataclass
class _Node:
    task: int
    state: object  # the environment's state at this node (``Env.reset`` / ``Env.step``)
    label: str = "root"  # its path from the root: joint action indices, e.g. ``root.2.0``


@dataclass
class _Level:
    """One turn of the tree: ``[nodes, J, agents]`` rewards (the task's; ``shaped``: the reward
    processor's, what returns are built from), each joint action's child node (-1: none), and each
    agent's generation."""

    rewards: torch.Tensor
    shaped: torch.Tensor
    children: torch.Tensor
    gens: list[Generation]


@dataclass
class _Tally:
    """What the rollout reports: sums of metrics over joint actions, per-turn metrics, stats."""

    sums: dict[str, float] = field(default_factory=dict)
    turn_metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(
        default_factory=lambda: {
            **dict.fromkeys(("perf/generate_s", "perf/reward_s", "perf/transition_s"), 0.0),
            "perf/generated_tokens": 0.0,
            "train/episodes": 0.0,
            "train/tree_nodes": 0.0,
        }
    )
    completions: list[list[str]] = field(default_factory=list)  # [agent][joint action of every turn]
    prompts: list[list[str]] = field(default_factory=list)  # [agent][joint action]: the prompt it answered
    truncated: int = 0
    responses: int = 0
    branching: int = 0  # nodes before the last turn
    stopped: int = 0  # ... that early termination ended
    sample: list[str] = field(default_factory=list)  # the first task's tree, rendered (``_render``)
    leaf_tasks: list[int] = field(default_factory=list)  # the task of each leaf, in order
    leaf_success: list[float] = field(default_factory=list)  # its ``success`` (or ``won``), where reported
    turn_success: torch.Tensor | None = None  # [nodes * J] of the turn being built, where reported

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value


def build_tree(
    agents: list[Agent],
    tasks: list[dict],
    env: Env,
    settings: TreeSettings,
    engine: Engine | None = None,
) -> RolloutBatch:
    """The joint tree of every task, its roots ``env.reset(tasks)``; ``engine`` generates (default:
    ``auto``). Per turn every joint action of every open node steps its own branch of the node's
    state, in ONE ``env.step`` call."""
    if settings.num_turns > 1 and not env.multi_turn:
        raise ValueError(f"num_turns={settings.num_turns} needs a transition that builds the next turn's prompts")
    engine = engine or make_engine("auto")
    if settings.tools is not None:
        give_tools(agents, settings.tools.tools, settings.tools.parser)
    combos = joint_indices(len(agents), settings.num_generations, settings.joint_mode)
    nodes = [_Node(t, state) for t, state in enumerate(env.reset(tasks))]
    try:
        return _grow(agents, tasks, env, settings, engine, combos, nodes)
    finally:  # what is still open (after an error): a game's states hold processes and workspaces
        env.release([node.state for node in nodes])


def _grow(agents, tasks, env: Env, settings: TreeSettings, engine: Engine, combos, nodes: list[_Node]) -> RolloutBatch:
    """The tree's turns from its ``nodes`` (the roots): each node's state is released once its
    joint actions stepped their own copies of it, a branch's last state once it ended."""
    tally = _Tally(completions=[[] for _ in agents], prompts=[[] for _ in agents])
    prefill = prefill_counts(engine)
    levels: list[_Level] = []
    for turn in range(settings.num_turns):
        t0 = time.perf_counter()
        gens, texts, rows = _generate(agents, tasks, nodes, settings, engine, not settings.chat_template)
        t1 = time.perf_counter()
        rewards, children, next_nodes = _step(env, nodes, texts, combos, turn, settings, tally, rows)
        shaped = rewards  # what returns are built from; logs and early termination use the task reward
        if settings.reward_processor:
            shaped = settings.reward_processor(rewards, _answer_lengths(texts, combos, len(nodes), settings))
        _tally_leaves(tally, nodes, children)
        tally.sample += _render(nodes, texts, combos, rewards, children, turn, settings.num_generations)
        levels.append(_Level(rewards, shaped, children, gens))
        stats = tally.stats
        stats["perf/generate_s"] += t1 - t0
        stats["perf/generated_tokens"] += sum(g.num_generated_tokens for g in gens)
        stats[f"turn_{turn}/nodes"] = float(len(nodes))
        stats["train/tree_nodes"] += float(len(nodes))
        stats["train/episodes"] += float((children < 0).sum())  # joint actions that end a branch: leaves
        if rows is None:  # a response without its end token hit max_new_tokens
            unclosed = [~(g.completion_ids == a.eos_token_id).any(-1) for a, g in zip(agents, gens)]
            tally.truncated += sum(int(u.sum()) for u in unclosed)
        else:  # its answer (the last reply) did: earlier replies closed with theirs
            counts = turn_counts(agents, rows)
            tally.truncated += int(counts.pop("truncated"))
            stats["perf/generate_s"] -= counts["perf/tool_s"]  # the calls ran between the rounds' generations
            for key, value in counts.items():
                stats[key] = stats.get(key, 0.0) + value
        tally.responses += len(agents) * len(nodes) * settings.num_generations
        env.release([node.state for node in nodes])
        nodes[:] = next_nodes  # in place: build_tree releases what is open if a turn raises
        if not nodes:
            break
    tally.stats.update(prefill_stats(engine, prefill))
    return _assemble(agents, levels, settings, tally)


def _generate(
    agents: list[Agent], tasks: list[dict], nodes: list[_Node], settings: TreeSettings, engine: Engine, raw: bool
) -> tuple[list[Generation], list[list[str]], list | None]:
    """ONE batched generation per model over all open nodes (the models together): each agent's
    generation (row n * G + k: response k at node n), its decoded texts, and with ``tools`` each
    agent's rows (the turn's tool rounds: ``tree_tools.tool_rounds``; its texts are the answers)."""
    G = settings.num_generations
    gens: list[Generation] = [None] * len(agents)
    groups = roles_by_model(agents)
    calls = []
    for roles in groups:
        agent = agents[roles[0]]
        encoded = [agent.encode_prompt(node.state.observations[i], raw=raw) for i in roles for node in nodes]
        calls.append((agent, encoded, G))
    seeds = None
    if settings.sampling_seed is not None and not settings.sampling.greedy:
        keys = [json.dumps(tasks[node.task], sort_keys=True, default=str) for node in nodes]
        seeds = [
            [stream_seed(settings.sampling_seed, key, node.label, i) for i in roles for key, node in zip(keys, nodes)]
            for roles in groups
        ]
    outputs = engine.generate_team(calls, settings.sampling, seeds)
    for roles, generated in zip(groups, outputs):
        for r, i in enumerate(roles):  # a parameter-shared model played several roles at once
            gens[i] = generated.rows(slice(r * len(nodes) * G, (r + 1) * len(nodes) * G))
    if settings.tools is not None:
        return tool_rounds(agents, gens, settings.tools, settings.sampling, engine)
    texts = [agent.decode(g.completion_ids, g.completion_mask) for agent, g in zip(agents, gens)]
    return gens, texts, None


def _step(env: Env, nodes, texts, combos, turn, settings: TreeSettings, tally: _Tally, rows=None):
    """Every joint action of the turn steps its own branch of its node's state, in ONE ``env.step``:
    the ``[nodes, J, agents]`` rewards (the env's; a skipped one its node's mean), each joint
    action's child (``[nodes, J]``, -1: none - the branch ended, the last turn, or early termination
    stopped the node: its mean reward exceeded ``early_termination_threshold``) and the children.
    ``rows`` (with ``data.tools``: each agent's rows, with their calls) go into the children's prompts
    with ``share: team``."""
    G, J, N = settings.num_generations, len(combos), len(tally.completions)
    last = turn + 1 >= settings.num_turns
    threshold = settings.early_termination_threshold

    def stopped(raw: torch.Tensor) -> torch.Tensor:  # [nodes]
        if threshold is None:
            return torch.zeros(len(nodes), dtype=torch.bool)
        return neutral_fill(raw.reshape(len(nodes), J, N)).mean(dim=(1, 2)) > threshold

    states = [env.branch(node.state) for node in nodes for _ in combos]
    actions = [[texts[i][n * G + k] for i, k in enumerate(combo)] for n in range(len(nodes)) for combo in combos]
    parents = [node.state for node in nodes for _ in combos]
    steps = env.step(states, actions, turn, last=last, keep=lambda raw: ~stopped(raw).repeat_interleave(J))
    for i in range(N):
        tally.completions[i] += [a[i] for a in actions]
        tally.prompts[i] += [parent.observations[i] for parent in parents]
    rewards = neutral_fill(steps.rewards.reshape(len(nodes), J, N)).clone()
    halted = stopped(rewards)
    ended = [s for s in range(len(states)) if last or halted[s // J] or steps.done[s]]
    cut = [s for s in ended if not steps.done[s]]  # the rollout ended them: the env may score them now
    for s, ending in zip(cut, env.end([states[s] for s in cut])):
        if ending is not None:  # a game that scores on submit, a sparse outcome at an early stop
            rewards[s // J, s % J] = torch.tensor(ending.rewards, dtype=rewards.dtype)
            if steps.success is not None:
                steps.success[s] = float(bool(ending.info.get("won", False)))
    env.release([states[s] for s in ended])
    for key, value in steps.metrics.items():
        tally.add(key, value * len(nodes) * J)
        tally.turn_metrics[f"turn_{turn}/{key}"] = value
    tally.turn_success = steps.success
    for key, seconds in steps.seconds.items():
        tally.stats[f"perf/{key}"] = tally.stats.get(f"perf/{key}", 0.0) + seconds
    tally.add(f"turn_{turn}/reward", float(rewards.mean(dim=2).sum()))
    if not last:
        tally.branching += len(nodes)
        tally.stopped += int(halted.sum())
        for key, value in steps.turn_metrics.items():
            tally.turn_metrics[f"turn_{turn}/{key}"] = value
    children = torch.full((len(nodes), J), -1, dtype=torch.long)
    next_nodes: list[_Node] = []
    for s, state in enumerate(states):
        n, j = divmod(s, J)
        if not (last or halted[n] or steps.done[s]):
            if rows is not None and settings.tools.share == "team":
                block = team_block([rows[i][n * G + k].calls for i, k in enumerate(combos[j])])
                state.observations = [observation + block for observation in state.observations]
            children[n, j] = len(next_nodes)
            next_nodes.append(_Node(nodes[n].task, state, f"{nodes[n].label}.{j}"))
    return rewards, children, next_nodes


def _answer_lengths(texts, combos, num_nodes: int, settings: TreeSettings) -> torch.Tensor:
    """``[nodes, J]``: each joint action's answer length in characters, summed over the agents."""
    G = settings.num_generations
    return torch.tensor(
        [[sum(len(texts[i][n * G + k]) for i, k in enumerate(combo)) for combo in combos] for n in range(num_nodes)],
        dtype=torch.float64,
    ).view(num_nodes, len(combos))


def _tally_leaves(tally: _Tally, nodes: list[_Node], children: torch.Tensor) -> None:
    """The task of every joint action that ends its branch, and its ``success`` where reported."""
    ends = (children < 0).tolist()
    success = None if tally.turn_success is None else tally.turn_success.tolist()
    for n, node in enumerate(nodes):
        for j, leaf in enumerate(ends[n]):
            if leaf:
                tally.leaf_tasks.append(node.task)
                if success is not None:
                    tally.leaf_success.append(success[n * len(ends[n]) + j])


SAMPLE_NODES, SAMPLE_JOINT_ACTIONS, SAMPLE_CHARS = 16, 8, 300


def _render(nodes, texts, combos, rewards, children, turn: int, G: int) -> list[str]:
    """The first task's nodes of this turn as Markdown lines (TensorBoard's text tab): each agent's
    prompt, then per joint action every agent's response and the joint action's reward. At most
    ``SAMPLE_NODES`` nodes, ``SAMPLE_JOINT_ACTIONS`` joint actions each, ``SAMPLE_CHARS`` per text."""
    lines = []
    mine = [n for n, node in enumerate(nodes) if node.task == 0][:SAMPLE_NODES]
    for n in mine:
        node = nodes[n]
        lines.append(f"**turn {turn}, node `{node.label}`**\n")
        lines += [
            f"- prompt of agent {i}: {markdown_line(o, SAMPLE_CHARS)}" for i, o in enumerate(node.state.observations)
        ]
        for j, combo in enumerate(combos[:SAMPLE_JOINT_ACTIONS]):
            child = int(children[n, j])
            end = f"continues at `{node.label}.{j}`" if child >= 0 else "ends"
            lines.append(f"- joint action {j}: reward **{float(rewards[n, j].mean()):.3f}**, {end}")
            lines += [
                f"    - agent {i}: {markdown_line(texts[i][n * G + k], SAMPLE_CHARS)}" for i, k in enumerate(combo)
            ]
        lines.append("")
    return lines


def _assemble(agents: list[Agent], levels: list[_Level], settings: TreeSettings, tally: _Tally) -> RolloutBatch:
    """Every agent's rows of every turn with their node and turn ids and the node each row's joint
    action led to; the tree's facts per turn (``TreeLevels``: the algorithm builds returns from
    them, ``RolloutBatch.score``); the rollout's metrics."""
    G = settings.num_generations
    samples_per_agent: list[list[AgentSamples]] = [[] for _ in agents]
    node_offset = 0
    for turn, level in enumerate(levels):
        num_nodes = level.children.shape[0]
        tally.sums[f"turn_{turn}/joint_actions"] = float(level.children.numel())
        if settings.joint_mode == "aligned" or G == 1:  # joint action k holds response k of every agent
            next_group = torch.where(level.children >= 0, level.children + node_offset + num_nodes, -1).reshape(-1)
        else:
            next_group = torch.full((num_nodes * G,), -1, dtype=torch.long)
        for i, g in enumerate(level.gens):
            device = g.completion_ids.device
            samples_per_agent[i].append(
                AgentSamples(
                    input_ids=torch.cat([g.prompt_ids, g.completion_ids], dim=1),
                    attention_mask=torch.cat([g.prompt_mask, g.attention], dim=1),
                    completion_mask=g.completion_mask,
                    returns=None,
                    group_ids=node_offset + torch.arange(num_nodes, device=device).repeat_interleave(G),
                    turn_ids=torch.full((num_nodes * G,), turn, device=device),
                    next_group=next_group.to(device),
                    rollout_logprobs=g.logprobs,
                )
            )
        node_offset += num_nodes
    turn_rewards = [lv.rewards.mean(dim=2).reshape(-1) for lv in levels]  # team mean per joint action
    all_rewards = torch.cat(turn_rewards)
    facts = TreeLevels(
        [lv.shaped for lv in levels], [lv.children for lv in levels], settings.joint_mode, G, settings.cross_return
    )
    return RolloutBatch(
        agents=[AgentSamples.cat(parts, agent.pad_token_id) for parts, agent in zip(samples_per_agent, agents)],
        rewards=all_rewards,
        metrics=_metrics(tally, len(levels), all_rewards.numel()),
        stats=_stats(tally),
        completions=tally.completions,
        prompts=tally.prompts,
        turn_rewards=turn_rewards,
        sample="\n".join(tally.sample),
        leaf_tasks=torch.tensor(tally.leaf_tasks, dtype=torch.long),
        leaf_success=torch.tensor(tally.leaf_success) if len(tally.leaf_success) == len(tally.leaf_tasks) else None,
        levels=facts,
    )


def _metrics(tally: _Tally, num_levels: int, num_joint_actions: int) -> dict[str, float]:
    """Means over joint actions: the reward's own metrics per turn and overall, each turn's reward."""
    metrics = dict(tally.turn_metrics)
    for key, total in tally.sums.items():
        if not key.startswith("turn_"):
            metrics[key] = total / num_joint_actions
    for turn in range(num_levels):
        count = tally.sums[f"turn_{turn}/joint_actions"]
        metrics[f"turn_{turn}/reward"] = tally.sums[f"turn_{turn}/reward"] / count
    return metrics


def _stats(tally: _Tally) -> dict[str, float]:
    stats = tally.stats
    stats["perf/tokens_per_s"] = stats["perf/generated_tokens"] / max(stats["perf/generate_s"], 1e-9)
    stats["train/truncated_frac"] = tally.truncated / tally.responses
    stats["train/completion_len"] = stats["perf/generated_tokens"] / tally.responses
    if tally.branching:
        stats["train/early_termination_frac"] = tally.stopped / tally.branching
    return stats
