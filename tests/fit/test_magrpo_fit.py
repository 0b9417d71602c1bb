"""MAGRPO end to end on the tiny random model: a few real training steps through Lightning."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from helpers import SGDRecordingMAGRPO, cli_fit, make_trainer, slogan_data, snapshot, tree_from_functions
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.generation import Sampling
from lit_marl.returns import group_advantages


def test_fit_updates_every_agent(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    before = [{n: p.detach().clone() for n, p in agent.model.named_parameters()} for agent in module.agents]
    # the two agents are separate copies that start equal
    assert all(torch.equal(before[0][n], before[1][n]) for n in before[0])
    assert module.agents[0].model is not module.agents[1].model

    trainer = make_trainer(tmp_path)
    # 16 tokens, not 8: the random model's 8-token replies are all too short for the slogan's
    # length check, so every group gets equal rewards, zero advantages and no update at all
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))

    assert trainer.global_step == 2 * 2  # one optimizer step per agent per training step
    metrics = trainer.callback_metrics
    for i in range(2):
        assert float(metrics[f"agent{i}/advantage_abs"]) > 0, "no learning signal: the check below is void"
    for i, agent in enumerate(module.agents):
        changed = [n for n, p in agent.model.named_parameters() if not torch.equal(p.detach(), before[i][n])]
        unchanged = sorted(set(before[i]) - set(changed))
        assert not unchanged, f"agent {i}: parameters not updated: {unchanged[:5]}"
        for p in agent.model.parameters():
            assert torch.isfinite(p).all()

    losses = {k: float(v) for k, v in metrics.items() if "loss" in k}
    assert set(losses) >= {"agent0/loss", "agent1/loss"}
    assert all(math.isfinite(v) for v in losses.values()), losses
    for key in ("train/reward", "train/reward_std", "val/reward", "val/success", "perf/generated_tokens"):
        assert key in metrics, sorted(metrics)
        assert math.isfinite(float(metrics[key]))
    assert 0.0 <= float(metrics["train/reward"]) <= 1.0

    events = list((tmp_path / "lightning_logs").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)


def test_fit_logs_to_tensorboard(tmp_path):
    """The event file holds the training scalars, not just a header."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    L.seed_everything(1)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3)
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 4}))
    acc = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward", "agent0/loss", "agent1/loss"} <= tags, tags


# --------------------------------------------------------------------------- advantages
def _length_reward(agent_completions, tasks):
    return [float(len(" ".join(agent[j] for agent in agent_completions))) for j in range(len(tasks))]


def _per_group_minus_mean(returns: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(returns)
    for g in group_ids.unique():
        rows = group_ids == g
        out[rows] = returns[rows] - returns[rows].mean()
    return out


def test_single_agent_advantages_are_grpo(tiny_agent):
    """With one agent, MAGRPO's advantage is GRPO's: r - mean(r) over the G samples of a prompt."""
    torch.manual_seed(0)
    tasks = [{"topic": t} for t in ("tea", "bread", "rockets")]
    batch = tree_from_functions(
        [tiny_agent],
        tasks,
        [[f"a slogan for {t['topic']}"] for t in tasks],
        _length_reward,
        4,
        sampling=Sampling(max_new_tokens=6),
    )
    samples = batch.agents[0]
    assert torch.equal(samples.returns, batch.rewards)
    expected = _per_group_minus_mean(batch.rewards, samples.group_ids)
    assert expected.abs().sum() > 0, "rewards equal within every group: the check below is void"
    module = MAGRPO(model="tiny-random", num_agents=1, advantage={"normalization": False})
    torch.testing.assert_close(module.advantages(samples).advantages, expected)
    # GRPO's scaling: the same, divided by the group's std
    scaled = MAGRPO(model="tiny-random", num_agents=1).advantages(samples).advantages
    stds = torch.stack([batch.rewards[samples.group_ids == g].std(unbiased=True) for g in samples.group_ids])
    torch.testing.assert_close(scaled, expected / stds.clamp(min=1e-3))


@pytest.mark.parametrize("baseline", ["mean", "raw", "max", "rloo"])
@pytest.mark.parametrize("scale", [False, True])
def test_advantages_follow_the_settings(tiny_agents, baseline, scale):
    torch.manual_seed(2)
    tasks = [{"topic": "tea"}, {"topic": "bread"}]
    prompts = [[f"line {i} for {t['topic']}" for i in range(2)] for t in tasks]
    batch = tree_from_functions(
        tiny_agents, tasks, prompts, _length_reward, 3, joint_mode="cross", sampling=Sampling(max_new_tokens=5)
    )
    module = MAGRPO(model="tiny-random", advantage={"mode": baseline, "normalization": scale})
    for samples in batch.agents:
        expected = group_advantages(samples.returns.view(2, 3), baseline, scale, 1e-3).reshape(-1)
        torch.testing.assert_close(module.advantages(samples).advantages, expected)


# --------------------------------------------------------------------------- through the CLI
def test_cli_fit_end_to_end(in_repo_root, tmp_path):
    cli = cli_fit(tmp_path, "--trainer.limit_train_batches", "2", "--data.sampling.max_new_tokens", "8")
    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 2 * 2
    assert isinstance(cli.model, MAGRPO) and len(cli.model.agents) == 2
    assert math.isfinite(float(cli.trainer.callback_metrics["agent0/loss"]))
    log_dir = tmp_path / "magrpo_slogan_tiny" / "version_0"
    assert (log_dir / "config.yaml").exists()
    assert list(log_dir.glob("events.out.tfevents.*"))


# --------------------------------------------------------------------------- the update itself


@pytest.mark.parametrize(
    "forward_batch_size, forward_token_budget, joint_mode, reduction",
    [
        (1, None, "aligned", "mean"),
        (3, None, "cross", "mean"),
        (64, None, "aligned", "mean"),
        (3, None, "aligned", "sum"),
        (None, 100, "cross", "mean"),  # passes cut by tokens: a few rows each
        (None, None, "aligned", "mean"),  # one pass
    ],
)
def test_update_is_the_policy_gradient(tmp_path, forward_batch_size, forward_token_budget, joint_mode, reduction):
    """Whatever the micro-batching and row skipping, an agent's step follows the gradient of
    -mean over rows of A * (mean or sum of the log-probs of the response's tokens)."""
    from lit_marl.agents import Agent
    from lit_marl.logprobs import completion_logprobs

    L.seed_everything(3)
    module = SGDRecordingMAGRPO(
        model="tiny-random",
        num_agents=2,
        max_grad_norm=0.0,
        memory={"forward_batch_size": forward_batch_size, "forward_token_budget": forward_token_budget},
        update={"logprob_reduction": reduction},
    )
    data = slogan_data(sampling={"max_new_tokens": 16}, num_generations=3, joint_mode=joint_mode, tasks_per_step=3)
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False).fit(module, datamodule=data)
    (batch,) = module.seen
    leaves_per_task = 3 if joint_mode == "aligned" else 3**2
    assert batch.rewards.shape == (3 * leaves_per_task,)
    assert all(len(samples) == 3 * 3 for samples in batch.agents)  # tasks x G rows per agent
    reference = Agent("tiny-random").model
    for i, (agent, samples) in enumerate(zip(module.agents, batch.agents)):
        advantages = module.advantages(samples).advantages
        assert advantages.abs().sum() > 0, "no learning signal: the check is void"
        with torch.no_grad():  # the agent's weights before the step
            for name, p in reference.named_parameters():
                p.copy_(module.before[i][name])
        reference.zero_grad()
        logprobs = completion_logprobs(reference, samples.input_ids, samples.attention_mask, samples.num_completion)
        mask = samples.completion_mask.float()
        seq_logprob = (logprobs * mask).sum(-1)
        if reduction == "mean":
            seq_logprob = seq_logprob / mask.sum(-1)
        (-(advantages * seq_logprob).mean()).backward()
        grads = dict(reference.named_parameters())
        for name, p in agent.model.named_parameters():
            step = module.before[i][name] - p.detach()
            expected = grads[name].grad if grads[name].grad is not None else torch.zeros_like(step)
            torch.testing.assert_close(step, expected, atol=1e-6, rtol=1e-3, msg=f"agent {i} {name}")


def test_gradient_norm_is_clipped_per_agent(tmp_path):
    L.seed_everything(3)
    module = SGDRecordingMAGRPO(model="tiny-random", num_agents=2, max_grad_norm=1e-3)
    data = slogan_data(sampling={"max_new_tokens": 16}, num_generations=3, tasks_per_step=3)
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False).fit(module, datamodule=data)
    for i, agent in enumerate(module.agents):
        step = torch.cat([(module.before[i][n] - p.detach()).flatten() for n, p in agent.model.named_parameters()])
        assert float(step.norm()) == pytest.approx(1e-3, rel=1e-2), f"agent {i}"


def test_lora_fit_trains_only_adapters(tmp_path):
    from lit_marl.agents import LoraSettings

    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, lora={"r": 4, "alpha": 8}, learning_rate=1e-2)
    assert module.lora == LoraSettings(r=4, alpha=8)
    module.configure_model()
    for agent in module.agents:
        trainable = {id(p) for p in agent.trainable_parameters()}
        names = [n for n, p in agent.model.named_parameters() if id(p) in trainable]
        assert names and all("lora_" in n for n in names)
        assert len(names) == 2 * 4 * 4  # A and B for q, k, v, o in each of the 4 layers
    before = [{n: p.detach().clone() for n, p in a.model.named_parameters()} for a in module.agents]
    make_trainer(tmp_path, limit_val_batches=0, logger=False).fit(
        module, datamodule=slogan_data(sampling={"max_new_tokens": 16})
    )
    for i, agent in enumerate(module.agents):
        for name, p in agent.model.named_parameters():
            if "lora_" in name:
                assert not torch.equal(p.detach(), before[i][name]), f"agent {i}: adapter {name} not updated"
            else:
                assert torch.equal(p.detach(), before[i][name]), f"agent {i}: base weight {name} changed"


def test_single_agent_fit(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=1, learning_rate=1e-2)
    data = slogan_data(
        agent_prompts=['Write a slogan for {topic} with "{word0}" and "{word1}".'], sampling={"max_new_tokens": 4}
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1
    assert math.isfinite(float(trainer.callback_metrics["agent0/loss"]))


def test_validate_and_test_are_greedy_rollouts(tmp_path):
    module = MAGRPO(model="tiny-random", num_agents=2)
    data = slogan_data(sampling={"max_new_tokens": 4}, eval_tasks_per_step=8)
    trainer = make_trainer(tmp_path, limit_val_batches=2, limit_test_batches=1, logger=False)
    (val,) = trainer.validate(module, datamodule=data, verbose=False)
    (test,) = trainer.test(module, datamodule=data, verbose=False)
    assert {"val/reward", "val/success", "val/distinct"} <= set(val)
    assert {"test/reward", "test/success"} <= set(test)
    # greedy: the first held-out batch scores the same in validation and test
    assert test["test/reward"] == pytest.approx(
        float(data.rollout(module.agents, data.val_tasks[:8], greedy=True).rewards.mean())
    )


def _checksum(agents) -> float:
    return float(sum(p.double().sum() for a in agents for p in a.model.parameters()))


def test_rollouts_come_from_the_current_weights(tmp_path):
    """Each training rollout is sampled after the previous update, with the weights it trains."""
    events = []

    class Recording(MAGRPO):
        def training_step(self, batch, batch_idx):
            events.append(("train", _checksum(self.agents)))
            return super().training_step(batch, batch_idx)

    data = slogan_data(sampling={"max_new_tokens": 16}, tasks_per_step=2)
    rollout = data.rollout

    def recording_rollout(agents, tasks, greedy, **kwargs):
        events.append(("rollout", _checksum(agents), greedy, len(tasks)))
        return rollout(agents, tasks, greedy, **kwargs)

    data.rollout = recording_rollout
    L.seed_everything(0)
    module = Recording(model="tiny-random", num_agents=2, learning_rate=1e-2)
    make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=1, logger=False).fit(module, datamodule=data)

    kinds = [e[0] for e in events]
    assert kinds == ["rollout", "train"] * 3 + ["rollout"], kinds
    for step in range(3):
        sampled, trained = events[2 * step], events[2 * step + 1]
        assert sampled[2] is False and sampled[3] == 2  # sampled training rollout of tasks_per_step tasks
        assert sampled[1] == trained[1], f"step {step}: rollout used stale weights"
    assert events[0][1] != events[2][1] != events[4][1], "the weights did not change between steps"
    assert events[-1][2] is True  # validation is greedy
    assert events[-1][1] == _checksum(module.agents)


def _snapshot(module):
    return [{n: p.detach().clone() for n, p in agent.model.named_parameters()} for agent in module.agents]


def _assert_unchanged(module, before, no_grad: bool = False):
    for i, agent in enumerate(module.agents):
        for n, p in agent.model.named_parameters():
            assert torch.equal(p.detach(), before[i][n]), n
            if no_grad:
                assert p.grad is None, n


def test_non_finite_loss_stops_training_with_weights_untouched(tmp_path, monkeypatch):
    """A NaN loss must never reach the weights: training stops with a clear error instead."""
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    before = _snapshot(module)
    original = MAGRPO.loss
    monkeypatch.setattr(MAGRPO, "loss", lambda self, mb, stats, i: original(self, mb, stats, i) * float("nan"))
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    with pytest.raises(FloatingPointError, match="agent0: non-finite loss"):
        trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    _assert_unchanged(module, before, no_grad=True)


def test_non_finite_steps_are_skipped_and_counted_up_to_the_limit(tmp_path, monkeypatch):
    """max_nonfinite_steps=2: the first two NaN steps are skipped (weights and AdamW state
    untouched, counted), the third stops the run."""
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, max_nonfinite_steps=2)
    module.configure_model()
    before = _snapshot(module)
    original = MAGRPO.loss
    monkeypatch.setattr(MAGRPO, "loss", lambda self, mb, stats, i: original(self, mb, stats, i) * float("nan"))
    trainer = make_trainer(tmp_path, limit_val_batches=0, limit_train_batches=5)
    with pytest.warns(RuntimeWarning, match="optimizer step skipped, weights unchanged"):
        with pytest.raises(FloatingPointError, match=r"3 such step\(s\), model.max_nonfinite_steps=2"):
            trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    assert module.nonfinite_skips == 3
    _assert_unchanged(module, before)
    assert all(not optimizer.state for optimizer in trainer.optimizers)  # AdamW never stepped


def test_a_non_finite_gradient_with_a_finite_loss_never_reaches_the_weights(tmp_path, monkeypatch):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    module.configure_model()
    before = _snapshot(module)
    original = MAGRPO.loss

    def inf_gradient(self, mb, stats, learner):
        loss = original(self, mb, stats, learner)
        weight = next(p for p in self.model_of(learner).parameters() if p.requires_grad)
        weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        return loss

    monkeypatch.setattr(MAGRPO, "loss", inf_gradient)
    trainer = make_trainer(tmp_path, limit_val_batches=0)
    with pytest.raises(FloatingPointError, match="agent0: a non-finite gradient"):
        trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    _assert_unchanged(module, before)


@pytest.mark.parametrize("name, mode", [("MAREINFORCE", "raw"), ("MAReMax", "max"), ("MARLOO", "rloo")])
def test_named_variants_fix_the_advantage_mode(name, mode, in_repo_root):
    import lit_marl.algorithms as algorithms
    from lit_marl.cli import build_cli

    cls = getattr(algorithms, name)
    assert cls(model="tiny-random").advantage.mode == mode
    with pytest.raises(ConfigError, match=f"{name} is MAGRPO with mode '{mode}'"):
        cls(model="tiny-random", advantage={"mode": "max" if mode != "max" else "raw"})
    cli = build_cli(
        args=["--config", "configs/magrpo/slogan_tiny.yaml", "--model", f"lit_marl.algorithms.{name}"], run=False
    )
    assert (
        type(cli.model) is cls and cli.model.advantage.mode == mode and cli.model.hparams["advantage"]["mode"] == mode
    )


def test_a_step_of_zero_advantages_still_steps_the_optimizer(tmp_path):
    """Every sibling ties, so the loss is exactly 0 and its rows are skipped; the optimizer still
    steps on zero gradients, as after the backward: weight decay shrinks the weights."""
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-3, weight_decay=0.1)
    module.configure_model()
    before = [snapshot(a.model) for a in module.agents]
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(reward_fn="helpers:constant_reward"))
    assert float(trainer.callback_metrics["agent0/advantage_abs"]) == 0.0
    for agent, weights in zip(module.agents, before):
        for name, p in agent.model.named_parameters():
            if name in weights:
                # decayed by lr * wd (the relative change 1e-4 is far above float32's tolerance)
                torch.testing.assert_close(p.detach(), weights[name] * (1 - 1e-3 * 0.1))


def test_bf16_mixed_precision_runs_rollouts_and_updates_in_bf16(tmp_path, monkeypatch):
    """``trainer.precision: bf16-mixed`` reaches every pass, including those outside Lightning's steps:
    the rollouts' decoder and the epoch-end update compute in bf16 but for the LM head (fp32 log-probs), the
    weights stay fp32 (the optimizer's master copy) and move, the losses stay finite."""
    from lit_marl.generation.decoder import Decoder

    L.seed_everything(0)
    # the buffer never fills within the 2 steps: the one update runs at the epoch's end (on_train_epoch_end)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, buffer={"size": 100})
    module.configure_model()
    before = [snapshot(agent.model) for agent in module.agents]
    decoded, trained = [], []
    build = Decoder.__init__

    def spy(self, models):
        build(self, models)
        decoded.append(self.embed.dtype)

    monkeypatch.setattr(Decoder, "__init__", spy)
    heads = []
    for agent in module.agents:
        mlp = agent.model.model.layers[0].mlp
        mlp.register_forward_hook(lambda m, i, out: trained.append(out.dtype) if torch.is_grad_enabled() else None)
        head = agent.model.get_output_embeddings()
        head.register_forward_hook(lambda m, i, out: heads.append(out.dtype) if torch.is_grad_enabled() else None)
    trainer = make_trainer(tmp_path, precision="bf16-mixed")
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    assert decoded and set(decoded) == {torch.bfloat16}
    assert trained and set(trained) == {torch.bfloat16}, "the update's passes ran outside autocast"
    assert heads and set(heads) == {torch.float32}, "the log-probs of the update came from a bf16 head"
    for agent, old in zip(module.agents, before):
        params = dict(agent.model.named_parameters())
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params.values())
        assert any(not torch.equal(params[n].detach(), old[n]) for n in old)
    assert all(math.isfinite(float(v)) for k, v in trainer.callback_metrics.items() if "loss" in k)
