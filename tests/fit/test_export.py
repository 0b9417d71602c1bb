"""HFExport: exported agents reload with from_pretrained and generate what they generated in training."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer, slogan_data
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.algorithms import MAGRPO
from lit_marl.callbacks import HFExport
from lit_marl.export import exported_team
from lit_marl.generation import Sampling, generate

PROMPTS = ["Write a slogan for a library.", "Write a slogan for a bakery with the word fresh."]


def greedy(agent: Agent) -> torch.Tensor:
    encoded = [agent.encode_prompt(p) for p in PROMPTS]
    return generate(agent, encoded, 1, sampling=Sampling(max_new_tokens=12, greedy=True)).completion_ids


@pytest.mark.parametrize("lora", [None, "merged", "adapter"])
def test_exported_agents_reload_and_generate_the_same(tmp_path, lora):
    L.seed_everything(0)
    settings = None if lora is None else {"r": 4, "alpha": 8}
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, lora=settings)
    export = HFExport(str(tmp_path / "export"), lora=lora or "merged")
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, callbacks=[export])
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    for i, agent in enumerate(module.agents):
        folder = tmp_path / "export" / f"agent{i}"
        if lora == "adapter":
            from peft import AutoPeftModelForCausalLM

            assert (folder / "adapter_config.json").exists() and not (folder / "model.safetensors").exists()
            reloaded = Agent("tiny-random")
            reloaded.model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
        else:
            assert (folder / "config.json").exists() and not (folder / "adapter_config.json").exists()
            reloaded = Agent(str(folder))  # a plain HF folder: from_pretrained, tokenizer included
        assert torch.equal(greedy(reloaded), greedy(agent)), f"agent {i}"
        if lora != "adapter":  # the trained weights, not the initial ones
            initial = Agent("tiny-random").model.state_dict()
            exported = reloaded.model.state_dict()
            assert exported.keys() == initial.keys()
            assert any(not torch.equal(exported[k], initial[k]) for k in initial), f"agent {i} did not train"
    # what `lit-marl chat --model` loads: team.json names each role's folder
    team = exported_team(str(tmp_path / "export"))
    assert [torch.equal(greedy(a), greedy(b)) for a, b in zip(team, module.agents)] == [True, True]


def test_bad_lora_mode():
    with pytest.raises(ConfigError, match="HFExport.lora='both'"):
        HFExport(lora="both")


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_agents_as_adapters_on_one_base(tmp_path, mode):
    """lora_shared_base: one copy of the base weights for the team, one adapter and optimizer per
    agent; each adapter learns on its own, the base stays frozen; each agent exports as itself."""
    L.seed_everything(1)
    module = MAGRPO(
        model="tiny-random", num_agents=2, learning_rate=5e-2, lora={"r": 4, "alpha": 8}, lora_shared_base=True
    )
    module.configure_model()
    a, b = (agent.model for agent in module.agents)
    assert a.shared is b.shared  # one base
    unique = {p.data_ptr() for p in module.parameters()}
    one_model = sum(1 for _ in Agent("tiny-random").model.parameters())
    assert len(unique) == one_model + 2 * len(a.own_parameters())  # the base once, plus two adapters
    own = [set(map(id, agent.trainable_parameters())) for agent in module.agents]
    assert own[0] and own[1] and not own[0] & own[1]  # each optimizer holds its own adapter only
    before = {n: p.detach().clone() for n, p in a.shared.named_parameters()}

    export = HFExport(str(tmp_path / "export"), lora=mode)
    trainer = make_trainer(tmp_path, limit_train_batches=2, limit_val_batches=0, callbacks=[export])
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
    changed = {n for n, p in a.shared.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all(".lora_" in n for n in changed)  # adapters learned, the base did not
    assert any(".agent0." in n for n in changed) and any(".agent1." in n for n in changed)
    for i, agent in enumerate(module.agents):
        folder = tmp_path / "export" / f"agent{i}"
        if mode == "adapter":
            from peft import AutoPeftModelForCausalLM

            reloaded = Agent("tiny-random")
            reloaded.model = AutoPeftModelForCausalLM.from_pretrained(str(folder))
        else:
            reloaded = Agent(str(folder))
        assert torch.equal(greedy(reloaded), greedy(agent)), f"agent {i}"


def adapters(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.agents.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("shared_base", [False, True])
def test_a_run_starts_from_an_exported_adapter(tmp_path, shared_base):
    """InitialWeights: a new run's agents start with the adapters an earlier run exported (RL from
    an SFT run), each role its own."""
    from lit_marl.callbacks import InitialWeights
    from lit_marl.export import export_team, load_adapters

    settings = dict(model="tiny-random", num_agents=2, learning_rate=5e-2, lora={"r": 4, "alpha": 8})
    L.seed_everything(0)
    first = MAGRPO(**settings, lora_shared_base=shared_base)
    export = HFExport(str(tmp_path / "export"), lora="adapter")
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, callbacks=[export]).fit(
        first, datamodule=slogan_data(sampling={"max_new_tokens": 8})
    )
    trained = adapters(first)
    seen = {}

    class Snapshot(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(adapters(pl_module))

    L.seed_everything(1)  # with a KL term whose reference is the policy as RL starts: the loaded adapters
    second = MAGRPO(**settings, lora_shared_base=shared_base, kl={"coef": 0.1}, kl_reference="rl_start")
    callbacks = [InitialWeights(str(tmp_path / "export")), Snapshot()]
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, callbacks=callbacks).fit(
        second, datamodule=slogan_data(sampling={"max_new_tokens": 8})
    )
    references = {k.replace("_reference.", "."): v for k, v in seen.items() if "_reference." in k}
    seen = {k: v for k, v in seen.items() if "_reference." not in k}
    assert seen.keys() == trained.keys() and all(torch.equal(seen[k], trained[k]) for k in trained)
    assert references.keys() == trained.keys() and all(torch.equal(references[k], trained[k]) for k in trained)
    export_team(second, tmp_path / "again", "adapter")  # the policy's adapters only, never the reference
    assert not list((tmp_path / "again").rglob("*_reference*"))
    L.seed_everything(2)
    third = MAGRPO(**settings, lora_shared_base=shared_base)
    third.configure_model()
    load_adapters(third, tmp_path / "again")
    assert all(torch.equal(v, trained[k]) for k, v in adapters(third).items())
    L.seed_everything(1)
    fresh = MAGRPO(**settings, lora_shared_base=shared_base)
    fresh.configure_model()
    assert any(not torch.equal(v, trained[k]) for k, v in adapters(fresh).items())  # the load did something


def test_initial_weights_refuses_what_does_not_fit(tmp_path):
    from lit_marl.export import export_team, load_adapters

    L.seed_everything(0)
    source = MAGRPO(model="tiny-random", num_agents=2, lora={"r": 4, "alpha": 8})
    source.configure_model()
    export_team(source, tmp_path / "adapter", "adapter")
    export_team(source, tmp_path / "merged", "merged")

    def target(**kwargs):
        module = MAGRPO(model="tiny-random", **{"num_agents": 2, **kwargs})
        module.configure_model()
        return module

    cases = [
        (target(lora={"r": 8, "alpha": 8}), tmp_path / "adapter", "this run's model.lora"),
        (target(), tmp_path / "adapter", "set model.lora"),
        (target(lora={"r": 4, "alpha": 8}), tmp_path / "merged", "a merged model"),
        (target(num_agents=3, lora={"r": 4, "alpha": 8}), tmp_path / "adapter", "has 2 agents, this run's 3"),
        (target(lora={"r": 4, "alpha": 8}), tmp_path / "nothing", "holds no team.json"),
        (target(lora={"r": 4, "alpha": 8}, share_parameters=True), tmp_path / "adapter", "share one model"),
    ]
    for module, folder, message in cases:
        with pytest.raises(ConfigError, match=f"InitialWeights.path.*{message}"):
            load_adapters(module, folder)
