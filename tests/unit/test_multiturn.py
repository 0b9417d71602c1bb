"""Multi-turn joint trees: tree sizes, returns, early termination, transitions, invariants."""

from __future__ import annotations

import pytest
import torch

from helpers import COMLRL_DOCS, comlrl_docs_transition, make_trainer, slogan_data, tree_from_functions
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.envs.calls import RewardError
from lit_marl.generation import Sampling
from lit_marl.returns import tree_returns
from lit_marl.rollout.transitions import plain

TASKS = [{"topic": "tea"}, {"topic": "winter"}]
TWO, THREE = Sampling(max_new_tokens=2), Sampling(max_new_tokens=3)  # tokens a reply


def _len_tree(agents, **settings):
    """A tree of the two tasks, 2 samples a node, replies of at most 2 tokens scored by their length."""
    return tree_from_functions(agents, TASKS, _prompts(2), _len_reward, 2, sampling=TWO, **settings)


def _prompts(num_agents: int) -> list[list[str]]:
    return [[f"agent {i}: write about {t['topic']}" for i in range(num_agents)] for t in TASKS]


def _len_reward(agent_completions, tasks):
    return [float(sum(len(agent[j]) for agent in agent_completions) % 7) for j in range(len(tasks))]


# --------------------------------------------------------------------------- returns (pure)
def _hand_tree():
    rewards = [torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 1.5], [2.0, 0.0]]), torch.tensor([[4.0, 2.0]])]
    children = [torch.tensor([[0, 1]]), torch.tensor([[0, -1], [-1, -1]]), torch.tensor([[-1, -1]])]
    return rewards, children


def test_tree_returns_discounted():
    rewards, children = _hand_tree()
    returns = tree_returns(rewards, children, discount=0.9)
    # level 2: leaves; level 1: 0.5 + 0.9 * mean(4, 2) = 3.2; level 0: 1 + 0.9 * mean(3.2, 1.5), 0 + 0.9 * mean(2, 0)
    torch.testing.assert_close(returns[2], torch.tensor([[4.0, 2.0]]))
    torch.testing.assert_close(returns[1], torch.tensor([[3.2, 1.5], [2.0, 0.0]]))
    torch.testing.assert_close(returns[0], torch.tensor([[1.0 + 0.9 * 2.35, 0.9 * 1.0]]))


def test_tree_returns_undiscounted_is_the_sum():
    rewards, children = _hand_tree()
    returns = tree_returns(rewards, children, discount=1.0)
    torch.testing.assert_close(returns[1], torch.tensor([[3.5, 1.5], [2.0, 0.0]]))
    torch.testing.assert_close(returns[0], torch.tensor([[3.5, 1.0]]))


def test_tree_returns_rejects_dangling_children():
    with pytest.raises(ValueError, match="no level below"):
        tree_returns([torch.zeros(1, 2)], [torch.tensor([[0, -1]])])


# --------------------------------------------------------------------------- tree sizes
@pytest.mark.parametrize(
    "joint_mode, G, T",
    [("aligned", 2, 1), ("aligned", 2, 2), ("aligned", 2, 3), ("aligned", 3, 2), ("cross", 2, 1), ("cross", 2, 2)]
    + [("cross", 2, 3), ("cross", 3, 2), ("aligned", 4, 1), ("aligned", 4, 3), ("cross", 4, 1)],
)
def test_node_and_leaf_counts(tiny_agents, joint_mode, G, T):
    from helpers import RecordingEngine

    engine = RecordingEngine()
    N = 2
    batch = tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(N),
        _len_reward,
        G,
        joint_mode,
        sampling=TWO,
        num_turns=T,
        transition=plain,
        engine=engine,
    )
    calls = engine.calls
    per_node = G if joint_mode == "aligned" else G**N
    for t in range(T):
        assert batch.stats[f"turn_{t}/nodes"] == len(TASKS) * per_node**t
    leaves = per_node**T  # aligned: G^T, cross: G^(N*T)
    total_joint_actions = len(TASKS) * sum(per_node ** (t + 1) for t in range(T))
    assert batch.rewards.numel() == total_joint_actions
    assert batch.stats[f"turn_{T - 1}/nodes"] * per_node == len(TASKS) * leaves
    # every node gives every agent G rows; breadth-first: one generate per agent per turn
    assert all(len(samples) == len(TASKS) * G * sum(per_node**t for t in range(T)) for samples in batch.agents)
    assert len(calls) == N * T


def test_early_termination_stops_branching(tiny_agents):
    def always_one(agent_completions, tasks):
        return [1.0] * len(tasks)

    kwargs = dict(sampling={"max_new_tokens": 2}, num_turns=3, transition=plain)
    stopped = tree_from_functions(
        tiny_agents, TASKS, _prompts(2), always_one, 2, early_termination_threshold=0.5, **kwargs
    )
    assert "turn_1/nodes" not in stopped.stats
    assert stopped.rewards.numel() == len(TASKS) * 2
    assert all(float(r) == 1.0 for r in stopped.agents[0].returns)  # no bootstrap from missing children
    going = tree_from_functions(
        tiny_agents, TASKS, _prompts(2), always_one, 2, early_termination_threshold=1.0, **kwargs
    )
    assert going.stats["turn_2/nodes"] == len(TASKS) * 4  # "exceeds": equal is not enough
    assert going.metrics["turn_0/return"] == pytest.approx(3.0)


# --------------------------------------------------------------------------- invariant: a single path


# --------------------------------------------------------------------------- transitions
def test_transition_sees_its_own_branch(tiny_agents):
    seen = []

    def recording(*, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        seen.append((list(agent_completions), [h[-1] for h in response_history_per_agent]))
        assert [len(h) for h in prompt_history_per_agent] == [len(h) for h in response_history_per_agent]
        return [f"{prompt_history_per_agent[i][0]} / revise: {agent_completions[i]}" for i in range(num_agents)]

    batch = tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(2),
        _len_reward,
        2,
        "cross",
        sampling=THREE,
        num_turns=2,
        transition=recording,
    )
    assert len(seen) == len(TASKS) * 4  # one per joint action of every non-terminal node
    assert all(completions == last for completions, last in seen)
    # the first-turn joint actions' completions are exactly what the transitions received
    first_turn = [[batch.completions[i][j] for i in range(2)] for j in range(len(TASKS) * 4)]
    assert first_turn == [completions for completions, _ in seen]


@pytest.mark.parametrize("field", [None, "question"])
def test_a_comlrl_transition_gets_the_task_prompt(tiny_agents, field):
    """Bug: ``prompt`` was the list of the agents' first prompts, so such a transition wrote a list
    repr into every next prompt. It is the task row's prompt text (``transition_prompt_field``)."""
    key = field or "prompt"
    tasks = [{"topic": "tea", key: "Write a slogan about tea."}, {"topic": "winter", key: "Write about winter."}]
    settings = {} if field is None else {"transition_prompt_field": field}
    seen = []

    class Recording:
        def __call__(self, **kwargs):
            seen.append(kwargs["prompt"])
            return comlrl_docs_transition(**kwargs)

    batch = tree_from_functions(
        tiny_agents,
        tasks,
        _prompts(2),
        _len_reward,
        2,
        sampling=THREE,
        num_turns=2,
        transition=Recording(),
        **settings,
    )
    assert sorted(set(seen)) == sorted(t[key] for t in tasks)  # a string: the task's own prompt
    second_turn = batch.agents[0].turn_ids == 1
    prompts = tiny_agents[0].tokenizer.batch_decode(batch.agents[0].input_ids[second_turn], skip_special_tokens=True)
    assert all(any(t[key] in p for t in tasks) for p in prompts)
    assert not any("['agent" in p or '["agent' in p for p in prompts)  # no list repr


def test_a_task_without_the_prompt_field_passes_the_empty_string(tiny_agents):
    seen = []

    def recording(**kwargs):
        seen.append(kwargs["prompt"])
        return comlrl_docs_transition(**kwargs)

    tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(2),
        _len_reward,
        2,
        sampling=THREE,
        num_turns=2,
        transition=recording,
    )
    assert set(seen) == {""}  # as CoMLRL's batch_item.get("prompt", "")


def test_the_data_module_warns_when_the_rows_lack_the_prompt_field():
    with pytest.warns(UserWarning, match=r"data.reward_calls.transition_prompt_field='prompt'.*empty string"):
        slogan_data(num_generations=2, num_turns=2, transition=COMLRL_DOCS)


@pytest.mark.parametrize("bad", [["only one"], "a string", ["ok", 3]])
def test_bad_transition_output_names_turn_and_task(tiny_agents, bad):
    def broken(**kwargs):
        return bad

    with pytest.raises(ValueError, match=r"must return 2 strings.*after turn 0 of task \{'topic': 'tea'\}"):
        _len_tree(tiny_agents, num_turns=2, transition=broken)


def test_multi_turn_without_transition_is_rejected(tiny_agents):
    with pytest.raises(ValueError, match="needs a transition"):
        tree_from_functions(tiny_agents, TASKS, _prompts(2), _len_reward, 2, sampling=TWO, num_turns=2)


def test_raw_prompts_skip_the_chat_template(tiny_agents, monkeypatch):
    raw_flags = []
    original = type(tiny_agents[0]).encode_prompt

    def spy(self, text, raw=False):
        raw_flags.append(raw)
        return original(self, text, raw=raw)

    monkeypatch.setattr(type(tiny_agents[0]), "encode_prompt", spy)
    kwargs = dict(sampling={"max_new_tokens": 2}, num_turns=2, transition=plain)
    tree_from_functions(tiny_agents, TASKS, _prompts(2), _len_reward, 2, chat_template=False, **kwargs)
    assert all(raw_flags) and len(raw_flags) > 2 * len(TASKS)  # every turn's prompts
    agent = tiny_agents[0]
    text = "plain text, no template"
    assert original(agent, text, raw=True) == agent.tokenizer(text)["input_ids"]  # as CoMLRL tokenizes
    assert original(agent, text) != original(agent, text, raw=True)


# --------------------------------------------------------------------------- config and a fit
def test_data_config_errors():
    with pytest.raises(ConfigError, match=r"data\.num_turns=2 needs data\.transition"):
        slogan_data(num_turns=2)
    with pytest.raises(ConfigError, match=r"data\.transition_kwargs"):
        slogan_data(num_turns=2, transition="lit_marl.rollout.transitions:plain", transition_kwargs={"nope": 1})
    with pytest.raises(ConfigError, match=r"data\.transition="):
        slogan_data(num_turns=2, transition="lit_marl.rollout.transitions:missing")
    with pytest.raises(ConfigError, match=r"model\.discount"):
        MAGRPO(discount=1.5)


@pytest.mark.parametrize("joint_mode", ["aligned", "cross"])
def test_two_turn_fit_updates_every_agent(tmp_path, joint_mode):
    import lightning as L

    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    before = [{n: p.detach().clone() for n, p in a.model.named_parameters()} for a in module.agents]
    data = slogan_data(
        num_turns=2,
        transition="lit_marl.rollout.transitions:plain",
        joint_mode=joint_mode,
        num_generations=2,
        sampling={"max_new_tokens": 16},
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    for key in ("turn_0/reward", "turn_1/reward", "turn_0/return", "agent0/loss"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    for i, agent in enumerate(module.agents):
        changed = sum(not torch.equal(p.detach(), before[i][n]) for n, p in agent.model.named_parameters())
        assert changed > 0, f"agent {i} did not move"


# --------------------------------------------------------------------------- bad rewards
def _raises_on_winter(agent_completions, tasks):
    if any(t["topic"] == "winter" for t in tasks):
        raise RuntimeError("scorer crashed")
    return [1.0 + j for j in range(len(tasks))]


def test_reward_that_raises_names_task_and_turn(tiny_agents):
    with pytest.raises(RewardError, match=r"raised RuntimeError: scorer crashed at turn 0 on tasks .*winter"):
        tree_from_functions(tiny_agents, TASKS, _prompts(2), _raises_on_winter, 2, sampling=TWO)


def test_nan_reward_names_task_and_turn(tiny_agents):
    calls = []

    def nan_later(agent_completions, tasks):
        calls.append(1)
        return [0.5 if len(calls) == 1 else float("nan")] * len(tasks)

    with pytest.raises(
        RewardError,
        match=r"nan_later returned a non-finite reward \(NaN/inf\) .*at turn 1, e.g. for tasks \[\{'topic': 'tea'\}",
    ):
        tree_from_functions(tiny_agents, TASKS, _prompts(2), nan_later, 2, sampling=TWO, num_turns=2, transition=plain)


def test_skip_mode_isolates_bad_rewards_and_keeps_training_data(tiny_agents):
    batch = tree_from_functions(
        tiny_agents,
        TASKS,
        _prompts(2),
        _raises_on_winter,
        2,
        sampling=TWO,
        on_reward_error="skip",
    )
    # tea's joint actions were scored one by one (1.0 each), winter's all failed: neutral 0
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch.metrics["skipped_reward_frac"] == pytest.approx(0.5)
    assert all(len(samples) == len(TASKS) * 2 for samples in batch.agents)  # no sample dropped


def test_skip_mode_fills_a_nan_with_its_node_mean(tiny_agents):
    def one_nan(agent_completions, tasks):
        return [float("nan") if j == 1 else float(j) for j in range(len(tasks))]

    batch = tree_from_functions(tiny_agents, TASKS, _prompts(2), one_nan, 3, sampling=TWO, on_reward_error="skip")
    # node 0 (tea) scored [0, NaN, 2] -> the NaN becomes mean(0, 2) = 1: advantage 0, baseline unchanged
    assert batch.rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert batch.metrics["skipped_reward_frac"] == pytest.approx(1 / 6)


def test_on_reward_error_config():
    with pytest.raises(ConfigError, match=r"data\.reward_calls\.on_reward_error='ignore'"):
        slogan_data(reward_calls={"on_reward_error": "ignore"})


# --------------------------------------------------------------------------- per-agent rewards
def _per_agent_reward(agent_completions, tasks):
    return [[float(j), 10.0 + 2 * j] for j in range(len(tasks))]


def test_per_agent_rewards_aligned(tiny_agents):
    batch = tree_from_functions(tiny_agents, TASKS, _prompts(2), _per_agent_reward, 2, sampling=TWO)
    assert batch.agents[0].returns.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert batch.agents[1].returns.tolist() == [10.0, 12.0, 14.0, 16.0]
    assert batch.rewards.tolist() == [5.0, 6.5, 8.0, 9.5]  # the team mean, for logging


def test_per_agent_rewards_cross(tiny_agents):
    G = 2
    batch = tree_from_functions(tiny_agents, TASKS, _prompts(2), _per_agent_reward, G, "cross", sampling=TWO)
    # task 0's joint actions j = 0..3 pair (k0, k1) = (0,0), (0,1), (1,0), (1,1)
    # agent 0, response k0=0: mean of its rewards at j=0,1 -> 0.5; k0=1: j=2,3 -> 2.5
    # agent 1, response k1=0: mean of its rewards at j=0,2 -> (10 + 14) / 2 = 12; k1=1: j=1,3 -> 14
    assert batch.agents[0].returns.tolist()[:2] == [0.5, 2.5]
    assert batch.agents[1].returns.tolist()[:2] == [12.0, 14.0]
    assert batch.agents[0].returns.tolist()[2:] == [4.5, 6.5]  # task 1: j = 4..7


def test_per_agent_tree_returns():
    rewards = [torch.tensor([[[1.0, 2.0], [0.0, 0.0]]]), torch.tensor([[[3.0, 5.0], [1.0, 1.0]]])]
    children = [torch.tensor([[0, -1]]), torch.tensor([[-1, -1]])]
    returns = tree_returns(rewards, children, discount=0.5)
    # the child node's mean return per agent is (2, 3): 1 + 0.5 * 2 = 2, 2 + 0.5 * 3 = 3.5
    torch.testing.assert_close(returns[0], torch.tensor([[[2.0, 3.5], [0.0, 0.0]]]))


def test_per_agent_rewards_of_the_wrong_width(tiny_agents):
    with pytest.raises(ValueError, match=r"give one float \(joint reward\) or 2 floats"):
        tree_from_functions(
            tiny_agents,
            TASKS,
            _prompts(2),
            lambda agent_completions, tasks: [[1.0]] * len(tasks),
            2,
            sampling=TWO,
        )


def test_batched_transition_is_called_once_per_turn(tiny_agents):
    calls = []

    def batched_plain(*, prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
        calls.append(len(prompt))
        return [
            plain(
                prompt=p,
                agent_completions=c,
                num_agents=num_agents,
                prompt_history_per_agent=ph,
                response_history_per_agent=rh,
            )
            for p, c, ph, rh in zip(prompt, agent_completions, prompt_history_per_agent, response_history_per_agent)
        ]

    kwargs = dict(sampling=Sampling(max_new_tokens=3, greedy=True), num_turns=3)
    batched = tree_from_functions(
        tiny_agents, TASKS, _prompts(2), _len_reward, 2, transition=batched_plain, batched_transition=True, **kwargs
    )
    assert calls == [len(TASKS) * 2, len(TASKS) * 4]  # every branch of a turn in one call
    one_by_one = tree_from_functions(tiny_agents, TASKS, _prompts(2), _len_reward, 2, transition=plain, **kwargs)
    assert batched.completions == one_by_one.completions


def test_batched_transition_must_answer_every_branch(tiny_agents):
    def short(**kwargs):
        return [["a", "b"]]

    with pytest.raises(ValueError, match="returned 1 results for 4 branches"):
        _len_tree(tiny_agents, num_turns=2, transition=short, batched_transition=True)


def test_a_transitions_metrics_are_logged_per_turn(tiny_agents):
    from lit_marl.envs.base import FunctionEnv
    from lit_marl.rollout.tree import TreeSettings, build_tree

    class Counting(FunctionEnv):
        calls = 0

        def transition(self, **kwargs):
            self.calls += 1
            return super().transition(**kwargs)

        def transition_metrics(self):
            return {"transition_calls": float(self.calls)}

    env = Counting(["{topic} A", "{topic} B"], _len_reward, plain)
    batch = build_tree(tiny_agents, TASKS, env, TreeSettings(num_generations=2, num_turns=3, sampling=TWO))
    assert batch.metrics["turn_0/transition_calls"] == 1.0 and batch.metrics["turn_1/transition_calls"] == 2.0
    assert "turn_2/transition_calls" not in batch.metrics  # the last turn opens no children
