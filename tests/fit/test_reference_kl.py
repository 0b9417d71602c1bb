"""Reference KL: the k3 estimate per response, subtracted from the reward before returns."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer, slogan_data, tree_from_functions
from lit_marl import ConfigError
from lit_marl.agents import LoraSettings
from lit_marl.algorithms import MAGRPO
from lit_marl.generation import Sampling, generate
from lit_marl.logprobs import completion_logprobs
from lit_marl.rollout.batch import AgentSamples

TASKS = [{"topic": "tea"}, {"topic": "winter"}]
PROMPTS = [[f"agent {i}: write about {t['topic']}" for i in range(2)] for t in TASKS]


def _module(lora=None) -> MAGRPO:
    module = MAGRPO(model="tiny-random", num_agents=2, kl={"coef": 0.5}, lora=lora)
    module.configure_model()
    return module


def _gen(module, index=0):
    agent = module.agents[index]
    torch.manual_seed(0)
    return generate(agent, [agent.encode_prompt(p[index]) for p in PROMPTS], 3, sampling=Sampling(max_new_tokens=6))


def _rows(gen):
    """The generation as the training rows the KL is computed on."""
    return AgentSamples(
        input_ids=torch.cat([gen.prompt_ids, gen.completion_ids], 1),
        attention_mask=torch.cat([gen.prompt_mask, gen.completion_mask], 1),
        completion_mask=gen.completion_mask,
        returns=None,
        group_ids=torch.arange(len(gen.prompt_ids)) // gen.num_samples,
        turn_ids=torch.zeros(len(gen.prompt_ids), dtype=torch.long),
    )


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4)])
def test_kl_is_zero_before_training(lora):
    module = _module(lora)
    assert module.kl.coef > 0
    assert (module.references is None) == (lora is not None)  # LoRA: the base is the reference, no copy
    torch.testing.assert_close(module.reference_kl(0, _rows(_gen(module))), torch.zeros(6), atol=1e-6, rtol=0)


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4)])
def test_kl_matches_the_k3_estimate(lora):
    module = _module(lora)
    with torch.no_grad():
        for p in module.agents[0].trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen = _gen(module)
    kl = module.reference_kl(0, _rows(gen))
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    C = gen.completion_ids.shape[1]
    model = module.agents[0].model
    with torch.no_grad():
        logp = completion_logprobs(model, ids, mask, C)
        if lora is None:
            ref = completion_logprobs(module.references[0], ids, mask, C)
        else:
            with model.disable_adapter():
                ref = completion_logprobs(model, ids, mask, C)
    d = ref - logp
    expected = 0.5 * ((d.exp() - d - 1) * gen.completion_mask).sum(-1)
    assert expected.min() > 0
    torch.testing.assert_close(kl, expected, atol=1e-5, rtol=1e-4)


def test_penalty_is_subtracted_from_each_agents_reward(tiny_agents):
    def reward(agent_completions, tasks):
        return [1.0] * len(tasks)

    penalties = [0.1 * torch.arange(4.0) + index for index in range(2)]  # row r of agent i costs 0.1 * r + i
    batch = tree_from_functions(
        tiny_agents, TASKS, PROMPTS, reward, 2, sampling=Sampling(max_new_tokens=2), penalties=penalties
    )
    torch.testing.assert_close(batch.agents[0].returns, 1.0 - 0.1 * torch.arange(4.0))
    torch.testing.assert_close(batch.agents[1].returns, 1.0 - 0.1 * torch.arange(4.0) - 1.0)
    assert batch.rewards.tolist() == [1.0] * 4  # logged rewards are the task's
    assert batch.metrics["penalty"] == pytest.approx(float((0.1 * torch.arange(4.0) + 0.5).mean()))


def test_fit_with_reference_kl(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, kl={"coef": 0.1}, lora=LoraSettings(r=4))
    trainer = make_trainer(tmp_path, limit_train_batches=2, limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/penalty"]) and float(metrics["train/penalty"]) >= 0
    # the KL itself, per agent: the penalty is the coefficient times the agents' mean KL
    kl = [float(metrics[f"agent{i}/kl_ref"]) for i in range(2)]
    assert float(metrics["train/penalty"]) == pytest.approx(0.1 * sum(kl) / 2, rel=1e-4)
    assert torch.isfinite(metrics["agent0/loss"])


def _nudge(module) -> None:
    """Move every agent's trained weights, as SFT (or InitialWeights) would before RL."""
    with torch.no_grad():
        for agent in module.agents:
            for p in agent.trainable_parameters():
                p.add_(torch.randn_like(p) * 0.05)


@pytest.mark.parametrize("lora, shared_base", [(None, False), (LoraSettings(r=4), False), (LoraSettings(r=4), True)])
def test_a_reference_at_rl_start_is_the_policy_then(lora, shared_base):
    """kl_reference: rl_start: the KL is 0 right after start_rl (the reference took the policy's
    weights, each learner its own) and grows again as the policy moves; under LoRA the reference is
    a frozen second adapter that no optimizer holds, and the agent's own adapter stays trainable."""
    torch.manual_seed(0)
    module = MAGRPO(model="tiny-random", num_agents=2, kl={"coef": 0.5}, lora=lora, lora_shared_base=shared_base,
                    kl_reference="rl_start")  # fmt: skip
    module.configure_model()
    _nudge(module)
    rows = [_rows(_gen(module, i)) for i in range(2)]
    assert all(float(module.reference_kl(i, rows[i]).min()) > 0 for i in range(2))  # still the initial weights
    module.start_rl()
    for i in range(2):
        torch.testing.assert_close(module.reference_kl(i, rows[i]), torch.zeros(6), atol=1e-6, rtol=0)
    _nudge(module)
    assert all(float(module.reference_kl(i, rows[i]).min()) > 0 for i in range(2))
    if shared_base:  # one base cannot play every role with its own reference adapter at once
        with pytest.raises(ConfigError, match="kl_reference: rl_start with lora_shared_base"):
            with module.initial_team():
                pass
    if lora is not None:
        assert module.references is None and any("_reference." in k for k in module.state_dict())  # checkpointed
        for agent in module.agents:
            agent.model.activate() if shared_base else None
            own = agent.trainable_parameters()
            names = {id(p): n for n, p in module.named_parameters()}
            assert own and all(p.requires_grad and "_reference" not in names[id(p)] for p in own)


def test_rl_start_after_sft_and_refused_without_a_kl_term(tmp_path):
    """PhaseSwitch hands the SFT weights to the reference at the switch: at the first RL step the
    policy's adapter and the reference adapter are equal, and differ from the adapter before SFT."""
    from helpers import REPO_ROOT
    from lit_marl import ConfigError
    from lit_marl.algorithms import PPO
    from lit_marl.callbacks.phase_switch import PhaseSwitch
    from lit_marl.data import EpisodeDataModule

    corridor = REPO_ROOT / "data" / "corridor"
    data = lambda: EpisodeDataModule(  # noqa: E731
        train_path=str(corridor / "train.jsonl"), env="corridor", tasks_per_step=2, max_turns=2,
        demos={"path": str(corridor / "demos.jsonl"), "batch_size": 4}, sampling={"max_new_tokens": 4},
    )  # fmt: skip
    seen = {}

    class FirstRLStep(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.phase == "rl" and not seen:
                seen.update({n: p.detach().clone() for n, p in pl_module.agents.named_parameters() if "lora_" in n})

    L.seed_everything(0)
    module = PPO(model="tiny-random", learning_rate=1e-2, kl={"coef": 0.1}, lora={"r": 4, "alpha": 8},
                 kl_reference="rl_start")  # fmt: skip
    initial = {}
    switch = PhaseSwitch(budget=6, split="4:2", sft_learning_rate=5e-2)
    trainer = make_trainer(tmp_path, max_epochs=-1, limit_val_batches=0, callbacks=[switch, FirstRLStep()])
    module.configure_model()
    initial.update({n: p.detach().clone() for n, p in module.agents.named_parameters() if ".default." in n})
    trainer.fit(module, datamodule=data())
    own = {n: v for n, v in seen.items() if ".default." in n}
    assert own and all(torch.equal(v, seen[n.replace(".default.", ".default_reference.")]) for n, v in own.items())
    assert any(not torch.equal(v, initial[n]) for n, v in own.items())  # SFT moved it
    with pytest.raises(ConfigError, match="kl_reference: rl_start without a KL term"):
        make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(
            PPO(model="tiny-random", kl_reference="rl_start"), datamodule=data()
        )
