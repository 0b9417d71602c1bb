"""The memory plan (``lit_marl.memory``): the activation profile measured on 1- and 2-layer copies
predicts what the whole model saves, the parts are the built models' exact bytes, and a plan that
does not fit stops the fit before its first step, naming the settings to change."""

from __future__ import annotations

import pytest
import torch

from helpers import make_trainer, slogan_data
from lit_marl import ConfigError
from lit_marl.activations import _saved_bytes, activation_profile, update_pass_bytes
from lit_marl.algorithms import MAGRPO
from lit_marl.generation import Sampling
from lit_marl.memory import GiB, kv_cache_bytes, plan, weight_parts
from lit_marl.models import load_model_and_tokenizer

LORA = {"r": 4, "alpha": 8}


def _saved_whole(model, tokens: int, autocast=None) -> int:
    """What the whole model saves for a forward of ``tokens`` tokens (1 scored)."""
    import lit_marl.activations as activations

    old = activations.PROFILE_VOCAB
    activations.PROFILE_VOCAB = 200
    try:
        return _saved_bytes(model, autocast, tokens)
    finally:
        activations.PROFILE_VOCAB = old


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_profile_predicts_the_whole_models_saved_activations(lora, autocast):
    """Measured on 1- and 2-layer copies with 64 tokens, the profile extrapolates to the real model's
    layers and another token count within 5 % (the test fails if a layer's bytes were mis-measured)."""
    model, _ = load_model_and_tokenizer("tiny-random")
    if lora:
        from peft import get_peft_model

        from lit_marl.agents import LoraSettings, lora_config

        model = get_peft_model(model, lora_config(LoraSettings(**LORA))).eval()
    profile = activation_profile(model, autocast)
    assert profile.layers == model.config.num_hidden_layers >= 2 and profile.per_layer_token > 0
    predicted = profile.pass_bytes(96, 0, checkpointing=False)
    measured = _saved_whole(model, 96, autocast)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_parts_are_the_models_bytes_and_a_plan_is_printed(tmp_path, capsys):
    module = MAGRPO(model="tiny-random", num_agents=2, lora=LORA, memory={"weights_dtype": "bfloat16"})
    module.configure_model()
    parts, phases = weight_parts(module)
    steps = ("rollout", "evaluation", "update")  # AdamW's state exists from the first step on, not at setup
    assert phases == {"gradients": ("update",), "AdamW state": steps, "weights gathered for a step": steps}
    trained = [p for p in module.parameters() if p.requires_grad]
    assert parts["gradients"] == sum(p.numel() * 4 for p in trained)
    assert parts["AdamW state"] == 2 * parts["gradients"]
    assert parts["weights"] == sum(
        p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values()
    )
    assert parts["weights gathered for a step"] == 0  # nothing sharded
    result = plan(module)
    assert result.peak >= parts["weights"] + parts["gradients"] + parts["AdamW state"]
    assert "activations of one update pass" in result.parts


def test_per_layer_parts_hold_two_units_and_sharded_gradients():
    """Per-layer FSDP2 over 4 ranks: a pass holds the root's own parameters and two decoder layers
    whole (not the model) beside the shards, and the next unit's all-gather buffer; the gradients are a
    quarter of the fp32 ones plus those units' unsharded ones; the whole model is gathered (a copy beside
    the shards) in the rollout only; the peak is the fullest phase."""
    from lit_marl.memory import fsdp_units

    module = MAGRPO(model="tiny-random", num_agents=1)
    module.configure_model()
    model = module.agents[0].model
    gathered, _ = weight_parts(module, shard_over=4, mode="gathered")
    per_layer, phases = weight_parts(module, shard_over=4, mode="per_layer")
    full = sum(p.numel() * 4 for p in model.parameters())
    own, units = fsdp_units(model)
    layers = [sum(p.numel() * 4 for p in params) for params, is_layer in units if is_layer]
    root = sum(p.numel() * 4 for p in own)
    assert gathered["weights gathered for a step"] == full + max(root, *layers)  # + the largest unit's buffer
    assert len(layers) == len(units) == model.config.num_hidden_layers  # tied embedding: it stays in the root
    assert per_layer["layers gathered in a pass"] == root + 2 * max(layers) + max(layers)
    assert per_layer["gradients"] == full / 4 + root + 2 * max(layers)
    assert per_layer["weights gathered for generation"] == 0  # no model named to generate with
    _, phases = weight_parts(module, shard_over=4, mode="per_layer", generation=[model])
    assert phases["weights gathered for generation"] == ("rollout", "evaluation") and phases["gradients"] == ("update",)
    result = plan(module, shard_over=4, mode="per_layer", capacity=64 * GiB)
    assert result.parts["weights gathered for generation"] == full + max(root, *layers)  # the agent generates
    held = {
        p: sum(v for k, v in result.parts.items() if p in result.phases.get(k, (p,))) for p in ("update", "rollout")
    }
    assert result.phase("update") == held["update"] and result.phase("rollout") == held["rollout"]
    assert result.peak == max(result.phase(p) for p in ("setup", "rollout", "evaluation", "update"))
    assert "FSDP2 per_layer" in result.table()
    low, _ = weight_parts(module, shard_over=4, mode="per_layer", gather_dtype="bfloat16")  # layers gathered in bf16
    assert low["layers gathered in a pass"] == root + max(layers) + max(layers) / 2


def test_per_layer_pass_holds_the_two_adjacent_units_in_forward_order():
    """An untied embedding and head are units of their own: a pass holds the embedding and the first
    layer, or the last layer and the head, whichever is larger (not the two largest units: they are
    never whole together); in bf16 the layers are gathered at half their fp32 bytes, the edges not."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lit_marl.memory import fsdp_units

    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    module = MAGRPO(model="tiny-random", num_agents=1)
    module.configure_model()
    module.agents[0].model = model = Qwen2ForCausalLM(config).eval()
    own, units = fsdp_units(model)
    sizes = [sum(p.numel() * 4 for p in params) for params, _ in units]
    assert [is_layer for _, is_layer in units] == [False, True, True, True, False] and sizes[0] > 2 * sizes[1]
    per_layer, _ = weight_parts(module, shard_over=2, mode="per_layer")
    root = sum(p.numel() * 4 for p in own)
    assert sizes[0] == sizes[4] and sizes[1] == sizes[3]  # embedding + first layer = last layer + head
    assert per_layer["layers gathered in a pass"] == root + sizes[0] + sizes[1] + sizes[0]  # + the edge's buffer
    low, _ = weight_parts(module, shard_over=2, mode="per_layer", gather_dtype="bfloat16")
    assert low["layers gathered in a pass"] == root + sizes[0] + sizes[1] / 2 + sizes[0]


def test_kv_cache_counts_keys_and_values_of_every_layer():
    model, _ = load_model_and_tokenizer("tiny-random")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    expected = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 3 * 100 * 2
    assert kv_cache_bytes(model, rows=3, tokens=100, dtype=torch.bfloat16) == expected


def test_a_plan_that_does_not_fit_stops_before_the_first_step(tmp_path, monkeypatch):
    import lit_marl.memory as memory

    monkeypatch.setattr(memory, "device_capacity", lambda device, ranks_here=1: 0.01 * GiB)
    module = MAGRPO(model="tiny-random", num_agents=2)
    with pytest.raises(ConfigError, match=r"(?s)memory plan needs .* GiB on this rank.*forward_token_budget"):
        make_trainer(tmp_path).fit(module, datamodule=slogan_data())
    assert module.global_step == 0
    skipped = MAGRPO(model="tiny-random", num_agents=2, memory={"check": False})
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(skipped, datamodule=slogan_data())
    assert skipped.global_step >= 1


def test_an_actor_critic_pass_counts_policy_and_critic_together():
    """PPO with a critic model runs policy and critic in one graph: the pass is their sum, the
    critic's without logits (it scores values, not tokens)."""
    from lit_marl.algorithms import PPO

    alone = PPO(model="tiny-random", memory={"forward_token_budget": 512})
    alone.configure_model()
    with_critic = PPO(model="tiny-random", critic={"kind": "model"}, memory={"forward_token_budget": 512})
    with_critic.configure_model()
    policy = update_pass_bytes(alone, None, [])
    profile = activation_profile(with_critic.critic_backbones[0], None)
    critic = profile.pass_bytes(with_critic.memory.forward_token_budget, 0, False)
    assert update_pass_bytes(with_critic, None, []) == pytest.approx(policy + critic)
    assert critic < policy  # no 12 bytes per vocabulary entry and scored position


def test_an_episode_pass_holds_its_longest_row_and_scores_the_agents_tokens():
    """A row longer than the token budget gets a pass of its own, so a pass holds up to an episode's
    ``max_context_tokens``; the LM head runs only at the agent's own tokens (``masked_logprobs``):
    at most ``max_turns x max_new_tokens`` a row, ``memory.forward_batch_size`` rows. With demonstrations
    (an SFT phase) every position counts."""
    from dataclasses import replace

    from lit_marl.algorithms import PPO
    from lit_marl.generation import make_engine
    from lit_marl.rollout.episode import EpisodeSettings
    from lit_marl.rollout.settings import RolloutSettings

    module = PPO(model="tiny-random", memory={"forward_token_budget": 512, "forward_batch_size": 2})
    module.configure_model()
    episode = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=8), max_context_tokens=1024)
    rollout = RolloutSettings("episodes", 1, 4, 1, make_engine("torch"), episode=episode)
    profile = activation_profile(module.model_of(0), None)
    notes = []
    assert update_pass_bytes(module, None, notes, rollout) == pytest.approx(profile.pass_bytes(1024, 2 * 3 * 8, False))
    assert notes == ["a pass of 1024 tokens, at most 48 scored (the agent's own tokens)"]
    demos = replace(rollout, demos=4)
    assert update_pass_bytes(module, None, [], demos) == pytest.approx(profile.pass_bytes(1024, 1024, False))
    assert update_pass_bytes(module, None, []) == pytest.approx(profile.pass_bytes(512, 512, False))


def test_vllm_engines_are_planned_by_their_share_or_their_kv_budget():
    """One vLLM instance per model: on a GPU its share of the card; on CPU (or with
    ``kv_cache_memory_bytes``) that KV budget plus its own copy of the weights, in the serving dtype."""
    from types import SimpleNamespace

    from lit_marl.generation.vllm import VLLMEngine

    module = MAGRPO(model="tiny-random", num_agents=2)
    module.configure_model()
    engine = VLLMEngine(backend_factory=lambda agent, dtype: None)
    data = SimpleNamespace(
        engine=engine, episode=None, generation_shape=lambda evaluation=False: None
    )  # an engine only
    numel = sum(p.numel() for p in module.parameters())  # two models, each served whole
    cpu = plan(module, data, capacity=64 * GiB)
    assert cpu.parts["vLLM engines (KV budget, weights)"] == 2 * 2**30 + numel * 4
    assert "generation KV cache" not in cpu.parts  # the lean decoder's cache is not used
    engine.llm_kwargs = {"kv_cache_memory_bytes": 2**28}
    bf16 = plan(module, data, capacity=64 * GiB, autocast=True)
    assert bf16.parts["vLLM engines (KV budget, weights)"] == 2 * 2**28 + numel * 2
    gpu = engine.options("cuda")
    assert gpu["gpu_memory_utilization"] == 0.3 and gpu["kv_cache_memory_bytes"] == 2**28
    assert (
        plan(module, data, vllm_share=0.25, capacity=64 * GiB).parts["vLLM engines (gpu_memory_utilization)"]
        == 0.25 * 2 * 64 * GiB
    )


def test_a_server_engines_generation_is_not_planned_on_the_trainer():
    """Rollouts on vLLM servers: no KV cache or engine copy on the trainer's device, only the weights
    streamed to the servers (two at most: a tied embedding and the current one); the plan says where
    generation runs."""
    from types import SimpleNamespace

    from lit_marl.generation import make_engine

    module = MAGRPO(model="tiny-random", num_agents=2)
    module.configure_model()
    data = SimpleNamespace(
        engine=make_engine("vllm_server"), episode=None, generation_shape=lambda evaluation=False: None
    )
    result = plan(module, data, capacity=64 * GiB)
    assert not any("KV" in name or "vLLM engines" in name for name in result.parts)
    largest = max(p.numel() for p in module.parameters())
    assert result.parts["weights in flight (server sync)"] == 2 * largest * 4
    assert any("vLLM servers' own GPUs" in note for note in result.notes)


def test_a_critic_model_carries_no_lm_head_and_reads_the_same_states():
    """A critic model is the decoder under the causal LM: no vocabulary x hidden head (nor its
    gradients and AdamW state), and the value head reads exactly the causal LM's final states."""
    from lit_marl.algorithms import PPO
    from lit_marl.logprobs import final_hidden_states

    module = PPO(model="tiny-random", critic={"kind": "model"})
    module.configure_model()
    backbone = module.critic_backbones[0]
    assert not any("lm_head" in name for name, _ in module.critic_backbones.named_parameters())
    full, _ = load_model_and_tokenizer("tiny-random")
    full.base_model.load_state_dict(backbone.state_dict())
    ids = torch.randint(5, 100, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    torch.testing.assert_close(final_hidden_states(backbone, ids, mask), final_hidden_states(full, ids, mask))
    policy = sum(p.numel() for p in module.agents[0].model.parameters())
    head = full.lm_head.weight.numel() if full.lm_head.weight is not full.base_model.embed_tokens.weight else 0
    assert sum(p.numel() for p in backbone.parameters()) == policy - head


def test_auto_mode_takes_gathered_when_it_fits_else_per_layer(monkeypatch):
    """FSDP2's ``auto``: the gathered plan's peak against the device (here made to fall between the
    two modes' peaks, then above both)."""
    from lit_marl import memory

    monkeypatch.setattr(memory, "process_overhead", lambda device, weights: float(GiB))  # not the live RSS
    module = MAGRPO(model="tiny-random", num_agents=1)
    module.configure_model()
    gathered = plan(module, shard_over=4, mode="gathered", capacity=64 * GiB).peak
    per_layer = plan(module, shard_over=4, mode="per_layer", capacity=64 * GiB).peak
    assert per_layer < gathered
    for capacity, expected in (((gathered + per_layer) / 2, "per_layer"), (2 * gathered, "gathered")):
        monkeypatch.setattr(memory, "device_capacity", lambda device, ranks=1, c=capacity: c)
        assert memory.choose_mode(module, None, 4, torch.device("cpu")) == expected


def test_the_kv_cache_kept_between_turns_is_planned_up_to_its_budget():
    """A multi-turn rollout with the lean engine holds the last turn's cache while the next one
    generates: its size (every live sequence) or the budget, whichever is smaller; a one-turn rollout
    and ``kept_kv_gib: 0`` hold none."""
    from types import SimpleNamespace

    from lit_marl.generation import TorchEngine

    module = MAGRPO(model="tiny-random", num_agents=2)
    module.configure_model()

    def data(turns, gib):
        shape = lambda evaluation=False: (4, 300, "test") if evaluation else (16, 600, "test")  # noqa: E731
        tree = SimpleNamespace(num_turns=turns)
        return SimpleNamespace(engine=TorchEngine(kept_kv_gib=gib), generation_shape=shape, episode=None, tree=tree)

    multi = plan(module, data(3, 4.0), capacity=64 * GiB)
    cache = multi.parts["generation KV cache"]
    assert multi.parts["KV cache kept between turns"] == cache and cache > multi.parts["evaluation KV cache"]
    assert plan(module, data(3, 0.5 * cache / GiB), capacity=64 * GiB).parts["KV cache kept between turns"] == (
        int(0.5 * cache / GiB * 2**30)
    )
    one_turn = plan(module, data(1, 4.0), capacity=64 * GiB, process=0.0)
    multi = plan(module, data(3, 4.0), capacity=64 * GiB, process=0.0)
    assert multi.phase("rollout") == pytest.approx(one_turn.phase("rollout") + cache)
    assert "KV cache kept between turns" in multi.held("evaluation")
    for turns, gib in ((1, 4.0), (3, 0)):
        assert "KV cache kept between turns" not in plan(module, data(turns, gib), capacity=64 * GiB).parts
