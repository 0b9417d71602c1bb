"""IAC and MAAC on single-trajectory episodes: rollout links, read positions, tiny-model fits,
the PPO-form invariant, the target-KL stop, and clear errors for bad settings."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from helpers import cli_fit, make_trainer, snapshot, tree_from_functions, two_turn_data, unchanged
from lit_marl import ConfigError
from lit_marl.algorithms import IAC, MAAC
from lit_marl.algorithms.critics import CriticInputs, critic_inputs, joint_critic_inputs, read_positions
from lit_marl.generation import Sampling
from lit_marl.returns import td_targets
from lit_marl.rollout.batch import AgentSamples
from lit_marl.rollout.transitions import plain


# --------------------------------------------------------------------------- the rollout
def test_single_trajectory_rollout_links_turns_and_keeps_rewards(tiny_agents):
    """G=1 aligned: one row per agent per turn and task; ``next_group`` points at the same task's
    next turn, none after the last played turn (an episode stopped early ends at turn 0)."""
    tasks = [{"id": 0, "stop": True}, {"id": 1, "stop": False}, {"id": 2, "stop": False}]

    def reward(agent_completions, tasks):
        return [1.0 if t["stop"] else 0.25 * t["id"] for t in tasks]

    torch.manual_seed(0)
    batch = tree_from_functions(
        tiny_agents,
        tasks,
        [["a", "b"]] * 3,
        reward,
        num_generations=1,
        sampling=Sampling(max_new_tokens=4),
        num_turns=3,
        transition=plain,
        early_termination_threshold=0.9,
    )
    for samples in batch.agents:
        # turn 0: tasks 0, 1, 2 (nodes 0-2); turn 1: tasks 1, 2 (nodes 3-4); turn 2: nodes 5-6
        assert samples.turn_ids.tolist() == [0, 0, 0, 1, 1, 2, 2]
        assert samples.group_ids.tolist() == list(range(7))
        assert samples.next_group.tolist() == [-1, 3, 4, 5, 6, -1, -1]
        assert samples.rewards.tolist() == [1.0, 0.25, 0.5, 0.25, 0.5, 0.25, 0.5]
    # the targets the actor-critic builds from these links, with values by hand
    s = batch.agents[0]
    values = torch.arange(7, dtype=torch.float32) / 10
    y = td_targets(s.rewards, values, s.next_group, gamma=0.9)  # one row per node: rows = groups
    assert torch.allclose(
        y, torch.tensor([1.0, 0.25 + 0.9 * 0.3, 0.5 + 0.9 * 0.4, 0.25 + 0.9 * 0.5, 0.5 + 0.9 * 0.6, 0.25, 0.5])
    )


def _samples() -> AgentSamples:
    # two rows, prompts left-padded to width 3 (row 0's prompt is 2 tokens), completions of 2 and 1
    # tokens (right-padded to width 2)
    return AgentSamples(
        input_ids=torch.tensor([[0, 11, 12, 13, 14], [21, 22, 23, 24, 0]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        completion_mask=torch.tensor([[1, 1], [1, 0]]),
        returns=torch.zeros(2),
        group_ids=torch.arange(2),
        turn_ids=torch.zeros(2, dtype=torch.long),
    )


def test_v_reads_the_last_prompt_token_and_q_the_last_response_token():
    samples = _samples()
    assert read_positions(samples, "v").tolist() == [2, 2]  # tokens 12 and 23
    assert read_positions(samples, "q").tolist() == [4, 3]  # tokens 14 and 24 (the end token)
    v = critic_inputs(samples, "v")
    assert v.input_ids.tolist() == [[0, 11, 12], [21, 22, 23]]  # V never sees the response
    assert v.input_ids[torch.arange(2), v.positions].tolist() == [12, 23]
    q = critic_inputs(samples, "q")
    assert q.input_ids[torch.arange(2), q.positions].tolist() == [14, 24]


def test_joint_critic_reads_every_agent_prompt_and_for_q_the_joint_action():
    a, b = _samples(), _samples()
    b.input_ids = b.input_ids + 100 * b.attention_mask
    v = joint_critic_inputs([a, b], "v", pad_id=0)
    rows = [row[m.bool()].tolist() for row, m in zip(v.input_ids, v.attention_mask)]
    assert rows == [[11, 12, 111, 112], [21, 22, 23, 121, 122, 123]]
    assert (v.positions == v.input_ids.shape[1] - 1).all()
    q = joint_critic_inputs([a, b], "q", pad_id=0)
    rows = [row[m.bool()].tolist() for row, m in zip(q.input_ids, q.attention_mask)]
    assert rows == [[11, 12, 13, 14, 111, 112, 113, 114], [21, 22, 23, 24, 121, 122, 123, 124]]


def test_critic_inputs_of_several_roles_keep_their_read_tokens():
    a, b = _samples(), _samples()
    b.input_ids = torch.cat([torch.tensor([[7], [7]]), b.input_ids], dim=1)  # one column wider
    b.attention_mask = torch.cat([torch.ones(2, 1, dtype=torch.long), b.attention_mask], dim=1)
    parts = []
    for s in (a, b):
        view = critic_inputs(s, "q")
        view.old_values = view.targets = torch.zeros(2)
        view.turn_ids = torch.zeros(2, dtype=torch.long)
        parts.append(view)
    both = CriticInputs.cat(parts, pad_id=0)
    assert both.input_ids.shape == (4, 6)
    assert both.input_ids[torch.arange(4), both.positions].tolist() == [14, 24, 14, 24]


# --------------------------------------------------------------------------- tiny-model fits
@pytest.mark.parametrize("critic, critic_type", [("head", "v"), ("model", "q")])
def test_iac_fit_moves_actors_and_critics(tmp_path, critic, critic_type):
    L.seed_everything(0)
    module = IAC(model="tiny-random", num_agents=2, learning_rate=1e-3, critic={"kind": critic, "type": critic_type})
    module.configure_model()
    actors = [snapshot(a.model) for a in module.agents]
    critics = [snapshot(c) for c in module.critics]
    assert len(module.critics) == 2  # one critic per agent
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data())
    for i, agent in enumerate(module.agents):
        assert not unchanged(agent.model, actors[i]), f"agent {i}: parameters not updated"
        assert all(torch.isfinite(p).all() for p in agent.model.parameters())
    for c, critic_module in enumerate(module.critics):
        assert not unchanged(critic_module, critics[c]), f"critic {c}: parameters not updated"
    metrics = trainer.callback_metrics
    for key in ("agent0/loss", "agent1/loss", "agent0/turn_1/value_mean", "turn_0/approx_kl"):
        assert math.isfinite(float(metrics[key])), key
    if critic == "model":  # separate optimizers: 2 actors + 2 critics, one step each per update, 2 updates
        assert trainer.global_step == 2 * 4
        assert math.isfinite(float(metrics["critic_agent0/loss"]))
    else:  # the head trains with its actor's optimizer
        assert trainer.global_step == 2 * 2


@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_maac_centralized_critic_steps_once_per_update(tmp_path, critic_type):
    L.seed_everything(1)
    module = MAAC(model="tiny-random", num_agents=2, learning_rate=1e-3, critic={"type": critic_type})
    module.configure_model()
    assert len(module.critics) == 1
    actors = [snapshot(a.model) for a in module.agents]
    critic = snapshot(module.critics[0])
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data())
    for i, agent in enumerate(module.agents):
        assert not unchanged(agent.model, actors[i]), f"agent {i}: parameters not updated"
    assert not unchanged(module.critics[0], critic)
    # two training steps = two updates: the critic's optimizer stepped exactly twice, not 2 x agents
    critic_optimizer = trainer.optimizers[-1]
    steps = {int(state["step"]) for state in critic_optimizer.state.values()}
    assert steps == {2}
    assert trainer.global_step == 2 * 3
    assert float(trainer.callback_metrics["critic/optimizer_steps"]) == 1.0
    assert math.isfinite(float(trainer.callback_metrics["critic/loss"]))


@pytest.mark.parametrize("algorithm", [IAC, MAAC])
def test_actors_move_with_one_task_per_step(tmp_path, algorithm):
    """Bug: with one episode per update each (agent, turn) group holds one row, and z-scoring centred
    it to 0: the critics learned, the actors never moved. A group of one keeps its raw advantage.
    A critic model (not a head on the actor) so that only the policy term reaches the actors."""
    L.seed_everything(5)
    module = algorithm(model="tiny-random", num_agents=2, learning_rate=1e-3, critic={"kind": "model"})
    module.configure_model()
    actors = [snapshot(a.model) for a in module.agents]
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data(tasks_per_step=1))
    for i, agent in enumerate(module.agents):
        assert not unchanged(agent.model, actors[i]), f"agent {i}: its actor never moved"
    advantage = float(trainer.callback_metrics["agent0/turn_0/advantage_mean"])
    assert advantage != 0.0 and math.isfinite(advantage)


@pytest.mark.parametrize("updates, steps", [("per_agent", 2), ("once", 1)])
def test_maac_per_agent_targets_reach_the_critic(tmp_path, updates, steps):
    """CoMLRL's MAAC: TD targets of each agent's own reward; the critic steps once per agent on its
    targets, or once on every agent's targets together."""
    L.seed_everything(6)
    module = MAAC(
        model="tiny-random", num_agents=2, learning_rate=1e-3, critic_reward="per_agent", critic_updates=updates
    )
    module.configure_model()
    assert [len(roles) for roles in module.critic_roles()] == ([1, 1] if updates == "per_agent" else [2])
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data())
    assert {int(state["step"]) for state in trainer.optimizers[-1].state.values()} == {2 * steps}  # two updates
    assert float(trainer.callback_metrics["critic/optimizer_steps"]) == float(steps)
    assert math.isfinite(float(trainer.callback_metrics["critic/loss"]))


@pytest.mark.parametrize("critic", ["head", "model"])
def test_parameter_shared_team_has_one_critic(tmp_path, critic):
    """One model plays both roles: one critic learns from both roles' rows."""
    L.seed_everything(3)
    module = IAC(model="tiny-random", num_agents=2, share_parameters=True, learning_rate=1e-3, critic={"kind": critic})
    module.configure_model()
    assert len(module.critics) == 1 and module.agents[0] is module.agents[1]
    before = snapshot(module.critics[0])
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data())
    # one learner: one step per update, plus one for its critic model
    assert trainer.global_step == 2 * (1 if critic == "head" else 2)
    assert not unchanged(module.critics[0], before)
    assert math.isfinite(float(trainer.callback_metrics["shared/loss"]))


def test_buffer_waits_for_its_size_and_the_epoch_end_flushes_the_rest(tmp_path):
    """Two steps of 3 episodes x 2 turns = 12 rows per agent, a buffer of 100: no update inside the
    epoch, one update on all 12 rows at its end (the module's on_train_epoch_end), none lost."""
    L.seed_everything(4)
    module = IAC(model="tiny-random", num_agents=2, learning_rate=1e-3, buffer={"size": 100})
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data(tasks_per_step=3))
    # one update, one step per agent (Lightning leaves steps taken at epoch end out of global_step)
    for optimizer in trainer.optimizers:
        assert {int(state["step"]) for state in optimizer.state.values()} == {1}
    assert all(len(buffer) == 0 for buffer in module.rollout_buffers)
    assert float(trainer.callback_metrics["agent0/optimizer_steps"]) == 1.0


def test_target_kl_stops_the_remaining_epochs(tmp_path):
    L.seed_everything(2)
    kwargs = dict(model="tiny-random", num_agents=2, learning_rate=1e-2, policy_loss="ppo")
    free = IAC(update={"ppo_epochs": 3}, **kwargs)
    trainer = make_trainer(tmp_path / "free", limit_val_batches=0, limit_train_batches=1)
    trainer.fit(free, datamodule=two_turn_data())
    assert float(trainer.callback_metrics["train/ppo_epochs_run"]) == 3
    # the KL is measured on each mini-batch's forward, before its step: epoch 1 (one mini-batch)
    # sees the behaviour policy itself (KL 0), epoch 2 the policy after one step, past any such KL
    stopped = IAC(update={"ppo_epochs": 3, "target_kl": 1e-12}, **kwargs)
    trainer = make_trainer(tmp_path / "stopped", limit_val_batches=0, limit_train_batches=1)
    trainer.fit(stopped, datamodule=two_turn_data())
    assert float(trainer.callback_metrics["train/ppo_epochs_run"]) == 2
    assert trainer.global_step == 2 * 2  # two epochs, one step per agent each


# --------------------------------------------------------------------------- invariant


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(critic={"type": "x"}), "model.critic.type='x'"),
        (dict(critic={"kind": "value"}), "model.critic.kind='value'"),
        (dict(policy_loss="a2c"), "model.policy_loss"),
        (dict(update={"ppo_epochs": 2}), "model.update.ppo_epochs"),
        (dict(policy_loss="ppo", update={"target_kl": 0.0}), "model.update.target_kl"),
        (dict(critic={"kind": "head", "model": "tiny-random"}), "model.critic.model"),
    ],
)
def test_bad_settings_fail_at_config_time(kwargs, field, no_model_loads):
    with pytest.raises(ConfigError) as err:
        IAC(model="tiny-random", **kwargs)
    assert field in str(err.value)
    assert no_model_loads == []


def test_maac_critic_is_a_model():
    with pytest.raises(ConfigError, match="model.critic.kind=head"):
        MAAC(model="tiny-random", critic={"kind": "head"})


def test_several_generations_with_several_turns_fail_before_loading(tmp_path, no_model_loads):
    module = MAAC(model="tiny-random", num_agents=2)
    with pytest.raises(ConfigError, match=r"data\.num_generations=2 with data\.num_turns=2.*num_generations=1"):
        make_trainer(tmp_path).fit(module, datamodule=two_turn_data(num_generations=2))
    assert no_model_loads == []


def test_critic_model_with_another_tokenizer_is_refused(tmp_path):
    from lit_marl.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-random")
    tokenizer.add_tokens(["<extra_token_a>", "<extra_token_b>"])
    model.save_pretrained(tmp_path / "critic")
    tokenizer.save_pretrained(tmp_path / "critic")
    for cls in (IAC, MAAC):
        module = cls(model="tiny-random", num_agents=2, critic={"kind": "model", "model": str(tmp_path / "critic")})
        with pytest.raises(ConfigError, match="another tokenizer than agent 0"):
            module.configure_model()


def test_cli_configs_run(in_repo_root, tmp_path):
    for config in ("configs/iac/slogan_tiny_2turn.yaml", "configs/maac/slogan_tiny_2turn.yaml"):
        cli = cli_fit(
            tmp_path,
            "--trainer.limit_train_batches=1",
            "--trainer.limit_val_batches=0",
            "--trainer.max_epochs=1",
            config=config,
        )
        assert cli.trainer.global_step >= 2
        assert math.isfinite(float(cli.trainer.callback_metrics["agent0/loss"]))
