"""``model.memory.weights_dtype: bfloat16``: the weights no optimizer updates (KL references, LoRA bases,
snapshots) are stored in bf16, the trained ones stay fp32 (the master copy) and so do LM heads;
the setting needs bf16-mixed autocast, and fits stay finite and move the trained weights."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import make_trainer, slogan_data, snapshot
from lit_marl import ConfigError
from lit_marl.algorithms import MAGRPO
from lit_marl.generation.vllm import compute_dtype
from lit_marl.logprobs import completion_logprobs
from lit_marl.models import store_frozen

LORA = {"r": 4, "alpha": 8}


def _dtypes(model: torch.nn.Module) -> dict[str, set[torch.dtype]]:
    """The dtypes of the trainable and the frozen parameters (the LM head apart)."""
    head = id(model.get_output_embeddings().weight)
    found: dict[str, set[torch.dtype]] = {"trainable": set(), "frozen": set(), "head": set()}
    for p in model.parameters():
        found["head" if id(p) == head else "trainable" if p.requires_grad else "frozen"].add(p.dtype)
    return found


def test_lora_base_is_stored_in_bf16_adapters_and_head_stay_fp32():
    module = MAGRPO(model="tiny-random", num_agents=2, lora=LORA, memory={"weights_dtype": "bfloat16"})
    module.configure_model()
    for agent in module.agents:
        assert _dtypes(agent.model) == {
            "trainable": {torch.float32},
            "frozen": {torch.bfloat16},
            "head": {torch.float32},
        }
    plain = MAGRPO(model="tiny-random", num_agents=2, lora=LORA)
    plain.configure_model()
    assert _dtypes(plain.agents[0].model)["frozen"] == {torch.float32}
    assert store_frozen(plain, "float32") == 0
    frozen = sum(p.numel() for p in plain.parameters() if not p.requires_grad and p.dim() > 0)
    head = plain.agents[0].model.get_output_embeddings().weight.numel() * 2  # two agents, a head each
    assert store_frozen(plain, "bfloat16") == 2 * (frozen - head), "every frozen fp32 weight but the heads"


def test_references_are_bf16_and_score_as_the_policy_at_the_start():
    """A full-fine-tuning team's KL references are frozen copies: bf16 but for the head. Under
    autocast the policy's fp32 weights are cast to bf16 per op, so at the start the reference's
    log-probs equal the policy's to bf16's rounding of the residual stream (a test that fails if the
    reference's head were bf16 or the policy's weights were changed)."""
    module = MAGRPO(model="tiny-random", num_agents=1, kl={"coef": 0.1}, memory={"weights_dtype": "bfloat16"})
    module.configure_model()
    policy, reference = module.agents[0].model, module.references[0]
    assert _dtypes(policy) == {"trainable": {torch.float32}, "frozen": set(), "head": {torch.float32}}
    assert _dtypes(reference) == {"trainable": set(), "frozen": {torch.bfloat16}, "head": {torch.float32}}
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mine = completion_logprobs(policy, ids, mask, 6)
        theirs = completion_logprobs(reference, ids, mask, 6)
    assert mine.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(mine, theirs, atol=0.05, rtol=0)


def test_bf16_weights_need_bf16_mixed_autocast(tmp_path):
    module = MAGRPO(model="tiny-random", num_agents=2, lora=LORA, memory={"weights_dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"trainer.precision: bf16-mixed"):
        make_trainer(tmp_path).fit(module, datamodule=slogan_data())


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full+kl"])
def test_bf16_weights_fit_moves_the_trained_weights(tmp_path, lora):
    """A bf16-mixed fit with bf16 frozen weights: finite losses, the trained (fp32) weights move, the
    frozen (bf16) ones do not."""
    kwargs = {"lora": LORA} if lora else {"kl": {"coef": 0.1}}
    module = MAGRPO(
        model="tiny-random", num_agents=2, learning_rate=1e-2, memory={"weights_dtype": "bfloat16"}, **kwargs
    )
    module.configure_model()
    before = [snapshot(agent.model) for agent in module.agents]
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    trainer = make_trainer(tmp_path, precision="bf16-mixed", limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 12}))
    assert all(math.isfinite(float(v)) for k, v in trainer.callback_metrics.items() if "loss" in k)
    for agent, old in zip(module.agents, before):
        params = dict(agent.model.named_parameters())
        moved = [n for n in old if params[n].requires_grad and not torch.equal(params[n].detach(), old[n])]
        assert moved and all(params[n].dtype == torch.float32 for n in moved)
    assert frozen and any(p.dtype == torch.bfloat16 for p in frozen.values())
    for name, p in module.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]) and p.dtype == frozen[name].dtype, name


def test_vllm_computes_in_the_trainers_dtype():
    assert compute_dtype("cpu") == "float32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype("cpu") == "bfloat16"


def test_every_agents_adapter_stays_fp32_on_a_shared_base():
    """peft turns grad on for the active adapter only, so on one shared base the other agents'
    adapters look frozen when the team is built: they are trained all the same and stay fp32."""
    module = MAGRPO(
        model="tiny-random", num_agents=3, lora=LORA, lora_shared_base=True, memory={"weights_dtype": "bfloat16"}
    )
    module.configure_model()
    for agent in module.agents:
        own = agent.trainable_parameters()
        assert own and {p.dtype for p in own} == {torch.float32}
    base = [p for n, p in module.named_parameters() if "lora_" not in n and p.dim() == 2]
    assert {p.dtype for p in base} == {torch.bfloat16, torch.float32}  # the head (and tied embedding) fp32
