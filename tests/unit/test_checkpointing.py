"""Activation checkpointing (``model.memory.activation_checkpointing``): which models it reaches, that a
checkpointed backward recomputes the layers and gives the plain backward's gradients, and that the
shared-prompt pass (one KV cache for a node's G rows) stays exact although a checkpointed layer drops
any cache it is given."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from helpers import SGDRecordingMAGRPO, make_trainer, slogan_data, snapshot
from lit_marl.algorithms import IAC, MAGRPO
from lit_marl.logprobs import completion_logits, completion_logprobs
from lit_marl.models import checkpoint_layers, checkpointed_passes, load_model_and_tokenizer, recomputes_activations

LORA = {"r": 4, "alpha": 8}


def _pair(lora: bool):
    """Two equal copies of the tiny model (LoRA adapters with nonzero B, so they get gradients that
    depend on the base's activations), the second checkpointed; both in eval mode, as they train."""
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        model, _ = load_model_and_tokenizer("tiny-random")
        if lora:
            from peft import get_peft_model

            from lit_marl.agents import LoraSettings, lora_config

            torch.manual_seed(1)
            model = get_peft_model(model, lora_config(LoraSettings(**LORA))).eval()
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(hash(name) % 2**31))
        models.append(model.eval())
    assert checkpoint_layers(models[1]) == 1
    return models


def _batch():
    ids = torch.randint(3, 200, (4, 14), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[2:, :9] = ids[0, :9]  # rows 0, 2, 3 share a 9-token prompt (as a node's G samples do)
    mask[2:, :9] = mask[0, :9]
    return ids, mask


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _count_passes(model, calls: dict, key: str) -> None:
    attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
    attention.register_forward_hook(lambda *_: calls.__setitem__(key, calls.get(key, 0) + 1))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointed_backward_recomputes_and_equals_the_plain_one(lora):
    plain, checkpointed = _pair(lora)
    ids, mask = _batch()
    calls = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        _count_passes(model, calls, name)
        with checkpointed_passes(model):
            assert recomputes_activations(model) == (model is checkpointed)
            logprobs = completion_logprobs(model, ids, mask, 5)
            (logprobs * torch.linspace(0.5, 2.0, 5)).sum().backward()
    assert calls == {"plain": 1, "checkpointed": 2}, "the checkpointed layer was not recomputed in the backward"
    assert not any(m.training for m in checkpointed.modules()), "the block left a module in training mode"
    assert not recomputes_activations(checkpointed)  # outside the block: the models' eval mode, no recompute
    ours, theirs = _grads(checkpointed), _grads(plain)
    assert ours.keys() == theirs.keys() and ours
    assert all(g.abs().sum() > 0 for g in theirs.values() if g.dim() > 1), "a void comparison"
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7, msg=name)


def test_shared_prompt_pass_stays_exact_under_checkpointing():
    """A checkpointed layer drops the KV cache (transformers sets ``cache=None``): the prompt-shared
    pass would then read the completions without their prompt. It must fall back to full rows."""
    plain, checkpointed = _pair(lora=False)
    ids, mask = _batch()
    groups = torch.tensor([0, 1, 0, 0])
    reference = completion_logits(plain, ids, mask, 5)  # one full pass per row
    with checkpointed_passes(checkpointed):
        shared = completion_logits(checkpointed, ids, mask, 5, prompt_groups=groups)
    torch.testing.assert_close(shared, reference, rtol=1e-5, atol=1e-5)
    reference.sum().backward()
    shared.sum().backward()
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(_grads(checkpointed)[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    with checkpointed_passes(checkpointed), torch.no_grad():  # no backward, no recompute: the cached pass runs
        assert not recomputes_activations(checkpointed)
        torch.testing.assert_close(completion_logits(checkpointed, ids, mask, 5, prompt_groups=groups), reference)


def test_the_block_flags_the_decoder_layers_alone():
    """Inside ``checkpointed_passes`` only the decoder layers are in training mode (what transformers
    checks before checkpointing); every submodule keeps eval mode, so nothing drops out, and the block
    restores them all."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    _, checkpointed = _pair(lora=True)
    with checkpointed_passes(checkpointed):
        training = [m for m in checkpointed.modules() if m.training]
        assert training and all(isinstance(m, GradientCheckpointingLayer) for m in training)
        assert len(training) == checkpointed.config.num_hidden_layers
    assert not any(m.training for m in checkpointed.modules())


def test_lora_dropout_is_refused():
    """The models run in eval mode (the update scores the sampling policy), so adapter dropout would
    never be what the user asked for: refused with the field and the fix."""
    from lit_marl import ConfigError
    from lit_marl.agents import LoraSettings

    with pytest.raises(ConfigError, match=r"model\.lora\.dropout=0\.1: .*Set it to 0"):
        LoraSettings(dropout=0.1)
    assert LoraSettings(dropout=0.0).dropout == 0.0


@pytest.mark.parametrize(
    "settings",
    [
        dict(cls=MAGRPO, lora=None),
        dict(cls=MAGRPO, lora=LORA, lora_shared_base=True),
        dict(cls=MAGRPO, share_parameters=True),
        dict(cls=IAC, critic={"kind": "model"}),
    ],
    ids=["separate", "lora-shared-base", "shared", "iac-critic-models"],
)
def test_the_setting_reaches_every_trainable_model(settings):
    settings = dict(settings)
    cls = settings.pop("cls")
    module = cls(model="tiny-random", num_agents=2, memory={"activation_checkpointing": True}, **settings)
    module.configure_model()
    checked = 0
    for model in module.modules():
        if hasattr(model, "is_activation_checkpointing") and any(p.requires_grad for p in model.parameters()):
            assert model.is_activation_checkpointing, type(model).__name__
            checked += 1
    critics = getattr(module, "critics", None) or []
    assert checked >= (1 if settings.get("lora_shared_base") or settings.get("share_parameters") else 2) + len(critics)
    plain = cls(model="tiny-random", num_agents=2, **settings)
    plain.configure_model()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())


def test_a_checkpointed_fit_trains_as_the_plain_one(tmp_path):
    """One MAGRPO step (G = 3 rows share each node's prompt) with and without checkpointing, same seed,
    SGD with lr 1 (an update is minus the gradient; Adam's first step would blow float rounding up to
    +-lr): the same rollouts, finite losses, parameters that move, and the same update."""
    ends, calls = [], {}
    for checkpointing in (False, True):
        L.seed_everything(0)
        module = SGDRecordingMAGRPO(
            model="tiny-random", num_agents=2, memory={"activation_checkpointing": checkpointing}
        )
        module.configure_model()
        before = [snapshot(agent.model) for agent in module.agents]
        in_backward = [False]  # layer passes run during a backward are recomputations
        backward = module.manual_backward

        def spied_backward(loss, backward=backward, flag=in_backward):
            flag[0] = True
            backward(loss)
            flag[0] = False

        module.manual_backward = spied_backward
        attention = next(m for n, m in module.agents[0].model.named_modules() if n.endswith("layers.0.self_attn"))
        counting = lambda *_, k=checkpointing, f=in_backward: calls.__setitem__(k, calls.get(k, 0) + f[0])  # noqa: E731
        attention.register_forward_hook(counting)
        trainer = make_trainer(tmp_path / str(checkpointing), limit_train_batches=1, limit_val_batches=0)
        trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}))
        assert all(torch.isfinite(v) for k, v in trainer.callback_metrics.items() if "loss" in k)
        for agent, old in zip(module.agents, before):
            assert any(not torch.equal(p.detach(), old[n]) for n, p in agent.model.named_parameters())
        ends.append([{n: p - old[n] for n, p in snapshot(a.model).items()} for a, old in zip(module.agents, before)])
    assert calls[False] == 0 and calls[True] > 0, f"the fit's update did not recompute: {calls}"
    for plain, checkpointed in zip(*ends):
        for name in plain:
            torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-7)


def test_the_lm_head_computes_in_fp32_under_bf16_autocast():
    """``prepare_models`` makes each LM head an ``FP32Linear``: under autocast its logits are the fp32
    product (a plain head's are bf16, off by up to ~1e-2 relative); copies keep their own weights."""
    from lit_marl.models import FP32Linear, prepare_models

    plain, _ = load_model_and_tokenizer("tiny-random")
    model = copy.deepcopy(plain)
    prepare_models(model, activation_checkpointing=False)
    head = model.get_output_embeddings()
    assert type(head) is FP32Linear and type(plain.get_output_embeddings()) is torch.nn.Linear
    assert model.state_dict().keys() == plain.state_dict().keys()
    hidden = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    exact = torch.nn.functional.linear(hidden, head.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = head(hidden), plain.get_output_embeddings()(hidden)
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, exact, rtol=1e-6, atol=1e-6)
    assert (theirs.float() - exact).abs().max() > 1e-3  # the check above is not void
    twin = copy.deepcopy(model)  # an iterative snapshot, a merged export: its own head, its own weights
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2)
    torch.testing.assert_close(head(hidden), exact)
    torch.testing.assert_close(twin.get_output_embeddings()(hidden), 2 * exact)


def test_an_actor_critic_fit_recomputes_in_its_one_pass_update(tmp_path):
    """IAC's default update forwards its rows once (``fits_one_pass``) before the backwards: those
    forwards must checkpoint too, actors and critic models alike, or the setting saves nothing."""
    from helpers import two_turn_data, unchanged

    L.seed_everything(0)
    module = IAC(
        model="tiny-random",
        num_agents=2,
        learning_rate=1e-3,
        critic={"kind": "model"},
        memory={"activation_checkpointing": True},
    )
    module.configure_model()
    before = [snapshot(a.model) for a in module.agents] + [snapshot(c) for c in module.critics]
    in_backward, calls = [False], {}
    backward = module.manual_backward

    def spied_backward(loss):
        in_backward[0] = True
        backward(loss)
        in_backward[0] = False

    module.manual_backward = spied_backward
    models = {"actor": module.agents[0].model, "critic": module.critics[0]}
    for name, model in models.items():
        attention = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn"))
        attention.register_forward_hook(lambda *_, k=name: calls.__setitem__(k, calls.get(k, 0) + in_backward[0]))
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=two_turn_data())
    assert calls.get("actor", 0) > 0 and calls.get("critic", 0) > 0, f"no recompute in the update: {calls}"
    after = [a.model for a in module.agents] + list(module.critics)
    assert all(not unchanged(model, old) for model, old in zip(after, before))
    assert all(torch.isfinite(v) for k, v in trainer.callback_metrics.items() if "loss" in k)
