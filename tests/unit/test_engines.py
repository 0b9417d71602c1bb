"""Generation engines: the lean torch decoder against transformers' generate, and the vLLM
engine's bookkeeping with a fake backend (vLLM itself needs a GPU)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

from helpers import lora_team
from lit_marl import ConfigError
from lit_marl.agents import Agent, LoraSettings, lora_config
from lit_marl.generation import HFEngine, Sampling, TorchEngine, left_pad, make_engine, mask_through_first
from lit_marl.generation.base import counter_uniforms
from lit_marl.generation.decoder import Decoder, unsupported
from lit_marl.generation.vllm import Sample, VLLMEngine, sampling_params
from lit_marl.generation.weights import effective_weights
from lit_marl.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def prompts(tiny_agent):
    texts = ["write one line of a slogan for a coffee cart with the word friend", "hi", "a b c d"]
    return [tiny_agent.encode_prompt(t) for t in texts]  # different lengths: left padding is exercised


def llama_agent(tokenizer, **config) -> Agent:
    torch.manual_seed(1)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=1000.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    settings.update(config)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    with torch.no_grad():  # random biases and norms so every term of the forward matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return Agent("llama-tiny", loaded=(model.eval(), tokenizer))


def adapter_team(tokenizer) -> list[Agent]:
    """Two agents as LoRA adapters ``agent0``/``agent1`` on one tiny Llama (``helpers.lora_team``)."""
    return lora_team(llama_agent(tokenizer).model, "llama-tiny", tokenizer)


def hf_greedy(agent, prompts, n, new):
    return HFEngine().generate(agent, prompts, n, sampling=Sampling(max_new_tokens=new, greedy=True)).completion_ids


def torch_greedy(agent, prompts, n, new):
    return TorchEngine().generate(agent, prompts, n, sampling=Sampling(max_new_tokens=new, greedy=True)).completion_ids


# --------------------------------------------------------------------------- the torch decoder
def test_torch_greedy_equals_generate_on_qwen2(tiny_agent, prompts):
    assert torch.equal(torch_greedy(tiny_agent, prompts, 2, 16), hf_greedy(tiny_agent, prompts, 2, 16))


def test_torch_greedy_equals_generate_on_llama_with_biases(tiny_agent, prompts):
    agent = llama_agent(tiny_agent.tokenizer)
    assert torch.equal(torch_greedy(agent, prompts, 1, 16), hf_greedy(agent, prompts, 1, 16))


def test_torch_decoder_logits_equal_the_training_forward(tiny_agent, prompts):
    """The distribution the decoder samples from at each step is the one training scores the
    tokens with (``completion_logprobs``): same positions, masks and RoPE under left padding."""
    agent = tiny_agent
    torch.manual_seed(0)
    gen = TorchEngine().generate(agent, prompts, 2, sampling=Sampling(max_new_tokens=8))
    decoder = Decoder(agent.model)
    seen = []
    original = decoder._sample

    def record(logits, *args):
        seen.append(logits.log_softmax(-1))
        return original(logits, *args)

    decoder._sample = record
    torch.manual_seed(0)
    ids, _ = decoder.generate(
        gen.prompt_ids, gen.prompt_mask, agent.eos_token_id, agent.pad_token_id, Sampling(max_new_tokens=8)
    )
    assert torch.equal(ids, gen.completion_ids)  # same seed, same samples
    ours = torch.stack(seen, 1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    input_ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    with torch.no_grad():
        theirs = completion_logprobs(agent.model, input_ids, mask, ids.shape[1])
    valid = gen.completion_mask.bool()
    assert torch.allclose(ours[valid], theirs[valid], atol=1e-4), (ours - theirs)[valid].abs().max()


def test_torch_decoder_stops_and_pads_after_end_token(tiny_agent, prompts):
    """Make the token greedy decoding emits third in row 0 the end token: that row ends there
    (padding after it), the others go on, exactly as generate does."""
    agent = tiny_agent
    first = torch_greedy(agent, prompts, 1, 6)
    eos = int(first[0, 2])

    class OtherEnd(Agent):
        eos_token_id = eos

    stopped = OtherEnd("tiny-random", loaded=(agent.model, agent.tokenizer))
    ours = TorchEngine().generate(stopped, prompts, 1, sampling=Sampling(max_new_tokens=6, greedy=True))
    theirs = HFEngine().generate(stopped, prompts, 1, sampling=Sampling(max_new_tokens=6, greedy=True))
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    end = first[0].tolist().index(eos)  # where row 0 now ends (the token may come earlier than third)
    width = ours.completion_ids.shape[1]
    assert ours.completion_mask[0].tolist() == [1] * (end + 1) + [0] * (width - end - 1)
    assert ours.completion_ids[0, end + 1 :].tolist() == [agent.pad_token_id] * (width - end - 1)
    assert torch.equal(ours.completion_mask, theirs.completion_mask)


def _s(temperature: float, top_p: float, top_k: int | None, greedy: bool) -> Sampling:
    return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)


def test_torch_sampling_follows_softmax_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    draws = 20000
    samples = torch.stack([Decoder._sample(logits, _s(1.0, 1.0, None, False)) for _ in range(draws)], 1)
    freq = torch.stack([torch.bincount(row, minlength=12) for row in samples]).float() / draws
    probs = logits.softmax(-1)
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / draws) + 1e-3
    # temperature scales the logits; top-p keeps exactly transformers' nucleus
    hot = torch.stack([Decoder._sample(logits, _s(2.0, 1.0, None, False)) for _ in range(draws)], 1)
    freq = torch.stack([torch.bincount(row, minlength=12) for row in hot]).float() / draws
    assert (freq - (logits / 2).softmax(-1)).abs().max() < 0.02
    nucleus = TopPLogitsWarper(0.7)(None, logits.clone()) > -float("inf")
    drawn = torch.zeros_like(nucleus)
    for _ in range(3000):
        drawn[torch.arange(4), Decoder._sample(logits, _s(1.0, 0.7, None, False))] = True
    assert torch.equal(drawn, nucleus)  # every nucleus token drawn, nothing outside it
    assert torch.equal(Decoder._sample(logits, _s(1.0, 1.0, None, True)), logits.argmax(-1))
    assert torch.equal(Decoder._sample(logits, _s(0.5, 0.7, 3, True)), logits.argmax(-1))  # greedy ignores them


def test_torch_top_k_of_one_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 3
    streams = counter_uniforms(torch.arange(8), 0)
    for temperature, top_p, uniforms in ((1.0, 1.0, None), (0.5, 0.9, None), (2.0, 1.0, streams)):
        assert torch.equal(Decoder._sample(logits, _s(temperature, top_p, 1, False), uniforms), logits.argmax(-1))


def test_torch_top_k_samples_only_the_k_most_likely():
    """One fixed logits row drawn 4000 times (torch's generator, and per-task streams): each of the
    k most likely tokens comes up, no other ever does; with top-k off (None or 0) every token does."""
    torch.manual_seed(0)
    logits = torch.linspace(2.0, -2.0, 20)[torch.randperm(20)]  # the most likely tokens scattered
    rows = logits.expand(4000, 20)
    top = set(torch.topk(logits, 5).indices.tolist())
    assert set(Decoder._sample(rows, _s(1.0, 1.0, 5, False)).tolist()) == top
    assert set(Decoder._sample(rows, _s(1.0, 1.0, 5, False), counter_uniforms(torch.arange(4000), 3)).tolist()) == top
    for off in (None, 0):
        assert len(set(Decoder._sample(rows, _s(1.0, 1.0, off, False)).tolist())) == 20


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, 1.0), (0.7, 10, 0.8), (1.5, 5, 0.6), (1.0, 100, 0.5)])
def test_torch_top_k_and_top_p_are_transformers_warpers_in_its_order(tiny_agent, temperature, top_k, top_p):
    """The logits the sampler draws from are those transformers' own sampling pipeline leaves (its
    temperature, top-k and top-p warpers, in its order; ties with the k-th token kept), and a grid of
    uniforms through the sampler gives each token that distribution's share."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    logits[0, :12] = torch.tensor([3.0, 3, 3, 2, 2, 2, 1, 1, 1, 0, 0, 0])  # ties across the k-th token
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    expected = tiny_agent.model._get_logits_processor(config)(None, logits.clone())
    ours = Decoder._warp(logits, _s(temperature, top_p, top_k, False))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))  # the same tokens kept
    torch.testing.assert_close(ours.softmax(-1), expected.softmax(-1))  # renormalized alike
    grid = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000  # inverse CDF: shares to one grid step
    drawn = Decoder._sample(logits.repeat_interleave(2000, 0), _s(temperature, top_p, top_k, False), grid.repeat(6))
    shares = torch.stack([torch.bincount(row, minlength=50) for row in drawn.view(6, 2000)]) / 2000
    assert (shares - expected.softmax(-1)).abs().max() <= 1 / 2000 + 1e-4
    assert not (shares[~torch.isfinite(expected)] > 0).any()


def test_torch_decoder_uses_lora_adapters_merged(tiny_agent, prompts):
    from peft import get_peft_model

    base = llama_agent(tiny_agent.tokenizer)
    model = get_peft_model(base.model, lora_config(LoraSettings(r=4, alpha=8)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained-looking adapter: changes the outputs
    agent = Agent("llama-tiny", loaded=(model.eval(), tiny_agent.tokenizer))
    ours = torch_greedy(agent, prompts, 1, 12)
    assert torch.equal(ours, hf_greedy(agent, prompts, 1, 12))
    with model.disable_adapter():
        plain = torch_greedy(agent, prompts, 1, 12)
        assert torch.equal(plain, hf_greedy(agent, prompts, 1, 12))
    assert not torch.equal(ours, plain)  # the adapter was really applied


def test_torch_decoder_adapter_views_decode_their_own_adapter(tiny_agent, prompts):
    agents = adapter_team(tiny_agent.tokenizer)
    outs = [torch_greedy(a, prompts, 1, 10) for a in agents]
    assert torch.equal(outs[0], hf_greedy(agents[0], prompts, 1, 10))
    assert torch.equal(outs[1], hf_greedy(agents[1], prompts, 1, 10))
    assert not torch.equal(outs[0], outs[1])


def test_unsupported_models_are_refused_by_torch_and_sent_to_generate_by_auto(tiny_agent, prompts):
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tiny_agent.tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=256)
    )
    agent = Agent("gpt2-tiny", loaded=(gpt2.eval(), tiny_agent.tokenizer))
    assert "gpt2" in unsupported(agent.model)
    with pytest.raises(ValueError, match="torch engine cannot decode.*gpt2.*use engine: hf"):
        TorchEngine().generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=4))
    auto = make_engine("auto").generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=6, greedy=True))
    assert torch.equal(auto.completion_ids, hf_greedy(agent, prompts, 1, 6))
    assert unsupported(tiny_agent.model) is None


def test_engine_names_are_checked(tmp_path):
    from helpers import slogan_data

    assert make_engine("hf").name == "hf" and make_engine("torch").name == "torch"
    assert make_engine("auto").name == "auto"
    with pytest.raises(ConfigError, match="data.engine='fast': choose one of auto, torch, hf, vllm"):
        slogan_data(engine="fast")
    with pytest.raises(ConfigError, match=r"data.engine_options: \['gpu_memory_utilization'\] unknown to the torch"):
        slogan_data(engine="torch", engine_options={"gpu_memory_utilization": 0.5})
    with pytest.raises(ConfigError, match="kept_kv_gib=-1: a number of GiB >= 0"):
        slogan_data(engine="auto", engine_options={"kept_kv_gib": -1})
    with pytest.raises(ConfigError, match="the hf engine takes none"):
        slogan_data(engine="hf", engine_options={"kept_kv_gib": 1})
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="data.engine=vllm: vllm is not installed"):
            slogan_data(engine="vllm")


def test_rollouts_through_both_engines_agree_when_greedy(tiny_agents):
    from helpers import tree_from_functions

    def reward(agent_completions, tasks, **_):
        return [len(a) / (1 + len(b)) for a, b in zip(*agent_completions)]

    kwargs = dict(num_generations=1, sampling=Sampling(max_new_tokens=8, greedy=True), reward_fn=reward)
    tasks = [{"t": 0}, {"t": 1}]
    prompts = [["say hi", "say ho"], ["write a b", "write c"]]
    a = tree_from_functions(tiny_agents, tasks, prompts, engine=make_engine("torch"), **kwargs)
    b = tree_from_functions(tiny_agents, tasks, prompts, engine=make_engine("hf"), **kwargs)
    assert a.completions == b.completions and torch.equal(a.rewards, b.rewards)


def test_every_engine_takes_top_k(tiny_agents, prompts):
    """Sampling with top-k 1 is greedy in each engine (the lean decoder alone and stacked, transformers'
    generate, and the auto engine's fallback for a model the decoder cannot run): top_k reaches the
    sampler. The tiny models' distributions are near uniform: without it no row would be greedy."""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_agents[0].tokenizer), n_embd=32, n_layer=1, n_head=2))
    gpt2 = Agent("gpt2-tiny", loaded=(gpt2.eval(), tiny_agents[0].tokenizer))
    torch.manual_seed(0)
    for name in ("torch", "hf"):
        calls = [(agent, prompts, 2) for agent in tiny_agents]
        sampled = make_engine(name).generate_team(calls, sampling=Sampling(max_new_tokens=6, temperature=1.5, top_k=1))
        for (agent, _, _), gen in zip(calls, sampled):
            assert torch.equal(gen.completion_ids, hf_greedy(agent, prompts, 2, 6)), name
    assert torch.equal(
        make_engine("auto").generate(gpt2, prompts, 2, sampling=Sampling(max_new_tokens=6, top_k=1)).completion_ids,
        hf_greedy(gpt2, prompts, 2, 6),
    )
    assert not torch.equal(
        make_engine("torch")
        .generate(tiny_agents[0], prompts, 2, sampling=Sampling(max_new_tokens=6, top_k=0))
        .completion_ids,
        hf_greedy(tiny_agents[0], prompts, 2, 6),
    )


# --------------------------------------------------------------------------- vLLM bookkeeping
class FakeBackend:
    """Answers like vLLM: per prompt, n samples; some stopped by the end token (vLLM keeps it in
    ``token_ids`` - or, as some versions do for stop ids, drops it), some cut by the length."""

    def __init__(self, agent, drop_stop_token=False, dtype="float32", sleeps=False):
        self.agent, self.drop, self.dtype, self.sleeps = agent, drop_stop_token, dtype, sleeps
        self.loads: list[dict[str, torch.Tensor]] = []
        self.calls = []
        self.events: list[str] = []  # sleep, wake_up:<tag>, load, generate: in order

    def load_weights(self, weights):
        self.loads.append({name: t.clone() for name, t in weights})
        self.events.append("load")

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self, tags):
        self.events += [f"wake_up:{t}" for t in tags]

    def add_adapter(self, name, folder):
        from safetensors.torch import load_file

        self.events.append(f"add_adapter:{name}")
        return name, load_file(f"{folder}/adapter_model.safetensors")

    def generate(self, prompts, params, adapter=None):
        self.calls.append((prompts, params))
        self.events.append("generate" if adapter is None else f"generate:{adapter[0]}")
        eos, max_tokens = params["stop_token_ids"][0], params["max_tokens"]
        out = []
        for i in range(len(prompts)):
            samples = []
            for k in range(params["n"]):
                length = (i + k) % (max_tokens + 1)  # 0 .. max_tokens tokens
                body = [100 + i * 10 + k] * length
                ids = body if self.drop or length == max_tokens else body + [eos]
                logprobs = [-0.5 - 0.1 * j for j in range(len(ids))]
                samples.append(Sample(ids, "stop" if length < max_tokens else "length", logprobs))
            out.append(samples)
        return out


@pytest.mark.parametrize("drop_stop_token", [False, True])
def test_vllm_rows_masks_and_padding(tiny_agent, prompts, drop_stop_token):
    backends = []
    engine = VLLMEngine(
        backend_factory=lambda a, dtype: backends.append(FakeBackend(a, drop_stop_token)) or backends[-1]
    )
    n, new = 3, 4
    gen = engine.generate(
        tiny_agent, prompts, n, sampling=Sampling(max_new_tokens=new, temperature=0.7, top_p=0.9, top_k=20)
    )
    eos, pad = tiny_agent.eos_token_id, tiny_agent.pad_token_id
    params = backends[0].calls[0][1]
    assert [params[k] for k in ("n", "max_tokens", "temperature", "top_p", "top_k")] == [n, new, 0.7, 0.9, 20]
    assert params["stop_token_ids"] == [eos]
    assert backends[0].calls[0][0] == prompts
    ids_ref, mask_ref = left_pad([p for p in prompts for _ in range(n)], pad, torch.device("cpu"))
    assert torch.equal(gen.prompt_ids, ids_ref) and torch.equal(gen.prompt_mask, mask_ref)
    assert gen.completion_ids.shape == (len(prompts) * n, new)
    for i in range(len(prompts)):
        for k in range(n):
            row, length = i * n + k, (i + k) % (new + 1)
            ids, mask = gen.completion_ids[row].tolist(), gen.completion_mask[row].tolist()
            if length < new:  # stopped: its tokens, then the end token, then padding
                assert ids[: length + 1] == [100 + i * 10 + k] * length + [eos]
                assert ids[length + 1 :] == [pad] * (new - length - 1)
                assert mask == [1] * (length + 1) + [0] * (new - length - 1)
            else:
                assert ids == [100 + i * 10 + k] * new and mask == [1] * new
    assert torch.equal(gen.completion_mask, mask_through_first(gen.completion_ids, eos))
    if drop_stop_token:  # the end token added back has no log-prob of its own: none are given
        assert gen.logprobs is None
    else:  # each sampled token's log-prob in its column, 0 after the end
        expected = torch.tensor([-0.5 - 0.1 * j for j in range(new)]) * gen.completion_mask
        assert torch.allclose(gen.logprobs, expected)
    greedy = engine.generate(tiny_agent, prompts, 1, sampling=Sampling(max_new_tokens=new, top_k=20, greedy=True))
    assert backends[0].calls[-1][1]["temperature"] == 0.0 and greedy.completion_ids.shape[0] == len(prompts)
    assert backends[0].calls[-1][1]["top_k"] == 0  # greedy: no top-k
    engine.generate(tiny_agent, prompts, 1, sampling=Sampling(max_new_tokens=new))
    assert backends[0].calls[-1][1]["top_k"] == 0  # off: vLLM's 0 (every token)


def test_vllm_sampling_params_carry_every_setting():
    """What ``SamplingParams`` gets from the run's ``Sampling`` (vLLM itself is tested in tests/vllm)."""
    sampling = Sampling(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=20)
    assert sampling_params(sampling, 2, [3]) == dict(
        n=2, max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[3], detokenize=False, logprobs=0
    )
    greedy = sampling_params(sampling.as_greedy(), 1, [3])  # vLLM's greedy: temperature 0, no top-p or top-k
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, 0)


def test_vllm_weights_sync_once_per_update(tiny_agents, prompts):
    agent = Agent("tiny-random")
    backends = []
    engine = VLLMEngine(backend_factory=lambda a, dtype: backends.append(FakeBackend(a, dtype=dtype)) or backends[-1])
    engine.generate(agent, prompts, 2, sampling=Sampling(max_new_tokens=3))
    engine.generate(agent, prompts, 2, sampling=Sampling(max_new_tokens=3))
    assert engine.syncs == 1 and len(backends) == 1  # no update in between: no reload
    loaded = backends[0].loads[0]
    assert set(loaded) == set(agent.model.state_dict())
    optimizer = torch.optim.SGD(agent.model.parameters(), lr=0.1)
    agent.model(input_ids=torch.tensor([prompts[1]])).logits.sum().backward()
    optimizer.step()
    engine.generate(agent, prompts, 2, sampling=Sampling(max_new_tokens=3))
    assert engine.syncs == 2
    name = "model.embed_tokens.weight"
    assert torch.equal(backends[0].loads[1][name], agent.model.state_dict()[name])
    assert not torch.equal(backends[0].loads[1][name], loaded[name])
    engine.generate(tiny_agents[0], prompts, 1, sampling=Sampling(max_new_tokens=3))  # another model: its own backend
    assert len(backends) == 2 and engine.syncs == 3


def test_vllm_weights_stream_in_the_rollouts_dtype(prompts):
    """Under bf16 autocast the engine serves bf16: its backend is opened so and every tensor is cast
    as it streams (one at a time: the stream is lazy); a tied weight is cast once and sent under both
    names; a rollout in another precision later is refused rather than served in the wrong dtype."""
    agent = Agent("tiny-random")
    lm = agent.model
    lm.lm_head.weight = lm.model.embed_tokens.weight  # tie them, as SmolLM2 and small Qwen2 do
    stream = effective_weights(agent.model, torch.bfloat16)
    first_name, first = next(stream)  # lazy: nothing else produced yet
    assert first.dtype == torch.bfloat16 and first_name == next(iter(lm.state_dict()))
    rest = dict(stream)
    assert rest["lm_head.weight"] is (
        first if first_name == "model.embed_tokens.weight" else rest["model.embed_tokens.weight"]
    )
    backends = []
    engine = VLLMEngine(backend_factory=lambda a, dtype: backends.append(FakeBackend(a, dtype=dtype)) or backends[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=3))
    assert backends[0].dtype == "bfloat16"
    assert {t.dtype for t in backends[0].loads[0].values()} == {torch.bfloat16}
    with pytest.raises(RuntimeError, match="serves bfloat16, but this rollout computes in float32"):
        engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=3))


def test_effective_weights_merge_the_active_adapter(tiny_agent):
    plain_names = set(llama_agent(tiny_agent.tokenizer).model.state_dict())
    view = adapter_team(tiny_agent.tokenizer)[1].model  # agent1's AdapterView
    state = dict(effective_weights(view))
    assert set(state) == plain_names
    merged = view.merged().state_dict()
    for name, tensor in merged.items():
        assert torch.allclose(state[name], tensor, atol=1e-6), name


def test_vllm_rollouts_sync_first_and_sleep_mode_frees_the_engine_for_the_update(prompts):
    """A rollout syncs every model first (in team order), generates; after it a sleeping instance
    frees weights and KV cache; the next rollout wakes the weights, syncs them in again (level 2
    dropped them, even with no update in between), wakes the KV cache, then generates. Without
    sleep mode nothing is freed and an unchanged model is not reloaded."""
    team = [Agent("tiny-random"), Agent("tiny-random")]
    for sleeps in (True, False):
        backends = []
        factory = lambda a, dtype, s=sleeps, b=backends: b.append(FakeBackend(a, dtype=dtype, sleeps=s)) or b[-1]  # noqa: E731
        engine = VLLMEngine(backend_factory=factory)
        for _ in range(2):
            with engine.rollout(team):
                assert [b.agent for b in backends] == team and all("load" in b.events for b in backends)
                engine.generate(team[1], prompts, 1, sampling=Sampling(max_new_tokens=3))
        if sleeps:
            assert backends[1].events == [
                "load",
                "generate",
                "sleep",
                "wake_up:weights",
                "load",
                "wake_up:kv_cache",
                "generate",
                "sleep",
            ]
            assert backends[0].events == ["load", "sleep", "wake_up:weights", "load", "wake_up:kv_cache", "sleep"]
        else:
            assert backends[1].events == ["load", "generate", "generate"] and backends[0].events == ["load"]
    assert VLLMEngine.options(engine, "cuda")["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine.options("cpu")  # vLLM's CPU build has no sleep mode


def test_a_lora_team_shares_one_instance_each_agent_sending_its_adapter(tiny_agent, prompts):
    """Agents whose adapters share one base (``lora_shared_base``) are served by one instance: the
    base is loaded once (unmerged, as the adapters switched off give it), each agent's adapter is
    saved and registered, and its generations name it; after an update of one agent's adapter only
    that adapter is sent again (a new name: vLLM caches by id), the base and the other stay."""
    backends = []
    engine = VLLMEngine(backend_factory=lambda a, dtype: backends.append(FakeBackend(a, dtype=dtype)) or backends[-1])
    team = adapter_team(tiny_agent.tokenizer)  # two AdapterView agents on one tiny Llama base
    shared = team[0].model.shared
    with engine.rollout(team):
        for agent in team:
            engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=3))
    assert len(backends) == 1 and engine.syncs == 1
    base = backends[0].loads[0]
    with shared.disable_adapter():
        plain = dict(effective_weights(shared))
    assert base.keys() == plain.keys() and all(torch.equal(base[n], plain[n]) for n in plain)
    events = ["load", "add_adapter:agent0-1", "add_adapter:agent1-2", "generate:agent0-1", "generate:agent1-2"]
    assert backends[0].events == events
    sent = backends[0].events
    optimizer = torch.optim.SGD(team[1].model.own_parameters(), lr=0.5)
    team[1].model(input_ids=torch.tensor([prompts[1]])).logits.sum().backward()
    optimizer.step()
    with engine.rollout(team):
        engine.generate(team[1], prompts, 1, sampling=Sampling(max_new_tokens=3))
    assert sent[5:] == ["add_adapter:agent1-3", "generate:agent1-3"] and engine.syncs == 1  # no base reload
    with shared.disable_adapter():  # the initial policy (MADPO's candidates): the base alone, adapters kept off
        with engine.rollout(team):
            engine.generate(team[0], prompts, 1, sampling=Sampling(max_new_tokens=3))
        assert sent[-1] == "generate" and all(m.disable_adapters for m in shared.modules() if hasattr(m, "lora_A"))


def test_a_kl_reference_adapter_is_not_served(tiny_agent):
    """A learner's frozen KL reference adapter (``kl_reference: rl_start``) sits beside its policy's on
    the shared base; vLLM is sized for the adapters agents sample from, never the reference."""
    from lit_marl.algorithms.references import build_reference_adapters
    from lit_marl.generation.vllm import served_adapters

    team = adapter_team(tiny_agent.tokenizer)
    assert set(served_adapters(team[0])) == {"agent0", "agent1"}
    build_reference_adapters([team[0].model])
    assert "agent0_reference" in team[0].model.shared.peft_config
    assert set(served_adapters(team[0])) == {"agent0", "agent1"}


def test_vllm_engine_options_need_the_default_backend():
    with pytest.raises(ValueError, match="default backend"):
        VLLMEngine(backend_factory=lambda a: None, gpu_memory_utilization=0.5)


# --------------------------------------------------------------------------- a team decoded together
def perturbed(agent: Agent, seed: int) -> Agent:
    """Another agent of the same shape with its own weights."""
    import copy

    model = copy.deepcopy(agent.model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return Agent(agent.source, loaded=(model.eval(), agent.tokenizer))


@pytest.mark.parametrize("samples", [(2, 1), (3, 3)], ids=["rows-expanded", "prompts-shared"])
def test_team_decodes_stacked_and_equals_each_agent_alone(tiny_agent, prompts, samples):
    """Two agents with their own weights, different row counts and prompt widths: one stacked
    forward per token gives each exactly what generate gives it alone, trimmed to its own widths.
    With one sample count for all (a tree turn: G each) each prompt runs once for its G samples."""
    from lit_marl.generation.decoder import stackable

    a, b = tiny_agent, perturbed(tiny_agent, 3)
    assert stackable([a.model, b.model])
    calls = [(a, prompts, samples[0]), (b, prompts[1:], samples[1])]  # b has fewer, narrower prompts
    team = TorchEngine().generate_team(calls, sampling=Sampling(max_new_tokens=12, greedy=True))
    for (agent, ps, n), out in zip(calls, team):
        alone = HFEngine().generate(agent, ps, n, sampling=Sampling(max_new_tokens=12, greedy=True))
        assert torch.equal(out.prompt_ids, alone.prompt_ids) and torch.equal(out.prompt_mask, alone.prompt_mask)
        assert torch.equal(out.completion_ids, alone.completion_ids)
        assert torch.equal(out.completion_mask, alone.completion_mask)
        assert out.num_samples == n
    assert not torch.equal(team[0].completion_ids[2], team[1].completion_ids[0])  # own weights: own text


def test_team_of_adapter_views_decodes_stacked(tiny_agent, prompts):
    from lit_marl.generation.decoder import stackable

    agents = adapter_team(tiny_agent.tokenizer)
    assert stackable([agent.model for agent in agents])
    team = TorchEngine().generate_team(
        [(agent, prompts, 1) for agent in agents], sampling=Sampling(max_new_tokens=10, greedy=True)
    )
    for agent, out in zip(agents, team):
        assert torch.equal(out.completion_ids, hf_greedy(agent, prompts, 1, 10))


def test_team_of_different_shapes_or_architectures_decodes_one_by_one(tiny_agent, prompts):
    from lit_marl.generation.decoder import stackable

    llama = llama_agent(tiny_agent.tokenizer)
    gpt2 = Agent(
        "gpt2-tiny",
        loaded=(
            GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_agent.tokenizer), n_embd=32, n_layer=1, n_head=2)).eval(),
            tiny_agent.tokenizer,
        ),
    )
    assert not stackable([tiny_agent.model, llama.model])  # qwen2 and llama shapes differ
    assert not stackable([tiny_agent.model, gpt2.model])
    calls = [(tiny_agent, prompts, 1), (llama, prompts, 1), (gpt2, prompts, 1)]
    team = make_engine("auto").generate_team(calls, sampling=Sampling(max_new_tokens=8, greedy=True))
    for (agent, ps, n), out in zip(calls, team):
        assert torch.equal(out.completion_ids, hf_greedy(agent, ps, n, 8))
    with pytest.raises(ValueError, match="gpt2"):
        TorchEngine().generate_team(calls, sampling=Sampling(max_new_tokens=8, greedy=True))


def test_team_sampling_draws_each_agent_from_its_own_model(tiny_agent, prompts):
    """Sampled (not greedy) team decoding: the tokens' log-probs under each agent's own training
    forward are those the decoder sampled from, and every row of an agent is its own."""
    a, b = tiny_agent, perturbed(tiny_agent, 4)
    torch.manual_seed(0)
    team = TorchEngine().generate_team([(a, prompts, 2), (b, prompts, 2)], sampling=Sampling(max_new_tokens=6))
    for agent, other, out in ((a, b, team[0]), (b, a, team[1])):
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
        with torch.no_grad():
            own = completion_logprobs(agent.model, ids, mask, out.completion_ids.shape[1])
            theirs = completion_logprobs(other.model, ids, mask, out.completion_ids.shape[1])
        valid = out.completion_mask.bool()
        assert torch.isfinite(own[valid]).all()
        assert own[valid].mean() > theirs[valid].mean()  # sampled from its own model, not the teammate's


def test_vllm_weight_version_changes_when_adapters_are_switched_off():
    """The vLLM engine reloads weights when this changes: the initial policy (adapters off, MADPO's
    offline candidates) must not be sampled from the trained weights vLLM holds, nor the reverse."""
    from peft import get_peft_model

    from lit_marl.agents import LoraSettings, lora_config
    from lit_marl.generation.weights import weight_version
    from lit_marl.models import load_model_and_tokenizer

    model = get_peft_model(load_model_and_tokenizer("tiny-random")[0], lora_config(LoraSettings(r=4, alpha=8)))
    on = weight_version(model)
    with model.disable_adapter():
        off = weight_version(model)
    assert on != off and weight_version(model) == on


def test_torch_decoder_under_bf16_autocast_computes_as_the_bf16_model(tiny_agent, prompts):
    """Under autocast (``trainer.precision: bf16-mixed``) the decoder casts the weights (LoRA merged)
    to bf16 once and decodes exactly as the same model stored in bf16 (RoPE frequencies stay fp32);
    the fp32 model is untouched."""
    import copy

    agent = llama_agent(tiny_agent.tokenizer)
    fp32 = [p.clone() for p in agent.model.parameters()]
    stored = copy.deepcopy(agent.model).to(torch.bfloat16)
    for ours, theirs in zip(agent.model.modules(), stored.modules()):
        if hasattr(ours, "inv_freq"):
            theirs.inv_freq = ours.inv_freq.clone()  # .to() cast the buffer; the decoder reads it in fp32
    ids, mask = left_pad(prompts, tiny_agent.pad_token_id, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = Decoder(agent.model)
        assert decoder.embed.dtype == torch.bfloat16
        under_autocast, _ = decoder.generate(
            ids, mask, -1, tiny_agent.pad_token_id, Sampling(max_new_tokens=12, greedy=True)
        )
    reference, _ = Decoder(stored).generate(
        ids, mask, -1, tiny_agent.pad_token_id, Sampling(max_new_tokens=12, greedy=True)
    )
    assert torch.equal(under_autocast, reference)
    fp32_ids, _ = Decoder(agent.model).generate(
        ids, mask, -1, tiny_agent.pad_token_id, Sampling(max_new_tokens=12, greedy=True)
    )
    assert Decoder(agent.model).embed.dtype == torch.float32  # outside autocast: as stored
    assert all(torch.equal(a, b) for a, b in zip(fp32, agent.model.parameters()))
    assert fp32_ids.shape == under_autocast.shape


def test_torch_decoder_keeps_an_fp32_head_under_bf16_autocast(tiny_agent, prompts):
    """With the team's ``FP32Linear`` head (``models.fp32_heads``) the decoder under autocast casts
    every weight to bf16 but the head, and decodes as a bf16 model with an fp32 head: it samples from
    the same head as the training forward scores."""
    import copy

    from lit_marl.models import fp32_heads

    agent = llama_agent(tiny_agent.tokenizer)
    assert fp32_heads(agent.model) == 1
    stored = copy.deepcopy(agent.model).to(torch.bfloat16)
    for ours, theirs in zip(agent.model.modules(), stored.modules()):
        if hasattr(ours, "inv_freq"):
            theirs.inv_freq = ours.inv_freq.clone()
    stored.lm_head.weight = torch.nn.Parameter(agent.model.lm_head.weight.detach().clone())  # fp32, untied
    ids, mask = left_pad(prompts, tiny_agent.pad_token_id, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = Decoder(agent.model)
        assert decoder.embed.dtype == torch.bfloat16 and decoder.lm_head[0].dtype == torch.float32
        under_autocast, _ = decoder.generate(
            ids, mask, -1, tiny_agent.pad_token_id, Sampling(max_new_tokens=12, greedy=True)
        )
    reference, _ = Decoder(stored).generate(
        ids, mask, -1, tiny_agent.pad_token_id, Sampling(max_new_tokens=12, greedy=True)
    )
    assert torch.equal(under_autocast, reference)


# --------------------------------------------------------------------------- per-task sampling streams
def test_counter_uniforms_are_uniform_and_depend_on_seed_and_step():
    from lit_marl.generation.base import counter_uniforms, sample_seeds, stream_seed

    seeds = sample_seeds(torch.tensor([stream_seed("run", t) for t in range(100)]), 100)  # 10k rows
    u = counter_uniforms(seeds, 0)
    assert len(set(seeds.tolist())) == len(seeds) and (u > 0).all() and (u < 1).all()
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (counts - 1000).abs().max() < 4 * math.sqrt(1000)  # within 4 sigma of uniform per decile
    later = counter_uniforms(seeds, 1)
    assert abs(float(torch.corrcoef(torch.stack([u, later]))[0, 1])) < 0.05  # steps look independent
    assert torch.equal(counter_uniforms(seeds, 0), u) and stream_seed("a", 1) == stream_seed("a", 1)


def test_seeded_samples_do_not_depend_on_the_batch(tiny_agent, prompts):
    """With seeds a prompt's samples are the same whether it is decoded alone, with other prompts,
    or stacked with another agent's call; without seeds the global generator decides (shared)."""
    seeds = [11, 22, 33]
    engine = TorchEngine()
    together = engine.generate_team([(tiny_agent, prompts, 3)], sampling=Sampling(max_new_tokens=10), seeds=[seeds])[0]
    alone = engine.generate_team(
        [(tiny_agent, prompts[1:2], 3)], sampling=Sampling(max_new_tokens=10), seeds=[seeds[1:2]]
    )[0]
    other = perturbed(tiny_agent, 3)
    stacked = engine.generate_team(
        [(other, prompts[:1], 2), (tiny_agent, prompts[1:2], 3)],
        sampling=Sampling(max_new_tokens=10),
        seeds=[[5], [22]],
    )[1]
    rows = slice(3, 6)  # prompt 1's three samples

    def texts(gen, rows=slice(None)):
        return tiny_agent.decode(gen.completion_ids[rows], gen.completion_mask[rows])

    assert texts(together, rows) == texts(alone) == texts(stacked)
    assert len(set(texts(together))) > 3  # samples differ between prompts and within one
    reseeded = engine.generate_team(
        [(tiny_agent, prompts[1:2], 3)], sampling=Sampling(max_new_tokens=10), seeds=[[23]]
    )[0]
    assert texts(reseeded) != texts(alone)
    with pytest.raises(ValueError, match="per_task needs the lean decoder, not the hf engine"):
        HFEngine().generate_team([(tiny_agent, prompts, 1)], sampling=Sampling(max_new_tokens=4), seeds=[seeds])


def test_per_task_streams_make_a_task_sample_the_same_tree_in_any_batch(tiny_agents):
    """The data module's per-task seeds through the tree builder: a task's candidates (and rewards)
    are the same rolled out with other tasks or alone, what makes 1 and N ranks agree
    (tests/distributed: the same preference pairs on 1 and 2 ranks)."""
    from dataclasses import replace

    from helpers import LENGTH_REWARD, slogan_data
    from lit_marl.rollout.tree import build_tree

    data = slogan_data(
        reward_fn=LENGTH_REWARD, num_generations=3, sampling={"max_new_tokens": 8}, sampling_streams="per_task"
    )
    tasks = data.train_tasks[:3]
    settings = replace(data.tree, sampling_seed=7)
    together = build_tree(tiny_agents, tasks, data.env, settings)
    alone = build_tree(tiny_agents, tasks[2:], data.env, settings)
    for agent_together, agent_alone in zip(together.completions, alone.completions):
        assert agent_together[6:] == agent_alone and len(set(agent_together)) > 3
    torch.testing.assert_close(together.rewards[6:], alone.rewards)
    other = build_tree(tiny_agents, tasks[2:], data.env, replace(settings, sampling_seed=8))
    assert other.completions != alone.completions


def test_data_top_k_reaches_the_tree_rollouts(tiny_agents):
    """``data.top_k`` through the tree settings to the engine: with top-k 1 every sampled response
    is the greedy one (the tiny models' distributions are near uniform: without it none would be)."""
    from helpers import LENGTH_REWARD, slogan_data

    data = slogan_data(reward_fn=LENGTH_REWARD, num_generations=2, sampling={"max_new_tokens": 6, "top_k": 1})
    assert data.tree.sampling.top_k == 1
    tasks = data.train_tasks[:2]
    sampled, greedy = data.rollout(tiny_agents, tasks, greedy=False), data.rollout(tiny_agents, tasks, greedy=True)
    for agent_sampled, agent_greedy in zip(sampled.completions, greedy.completions):
        assert agent_sampled == [text for text in agent_greedy for _ in range(2)]
    assert slogan_data(reward_fn=LENGTH_REWARD).tree.sampling.top_k is None  # off by default, or with 0
    assert slogan_data(reward_fn=LENGTH_REWARD, sampling={"top_k": 0}).tree.sampling.top_k == 0


@pytest.mark.parametrize("name", ["torch", "hf"])
def test_engines_return_the_raw_log_probs_of_their_samples(tiny_agents, prompts, name):
    """Each sampled token's log-prob as the engine computed it: the raw model distribution (before
    temperature, top-k and top-p), the quantity the training forward recomputes; 0 after the end. A stacked
    team gives each agent its own model's."""
    from lit_marl.logprobs import completion_logprobs

    torch.manual_seed(0)
    calls = [(agent, prompts, 2) for agent in tiny_agents]
    for agent, gen in zip(
        tiny_agents,
        make_engine(name).generate_team(
            calls, sampling=Sampling(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20)
        ),
    ):
        ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
        mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
        with torch.no_grad():
            expected = completion_logprobs(agent.model, ids, mask, gen.completion_ids.shape[1])
        assert torch.allclose(gen.logprobs, expected * gen.completion_mask, atol=1e-4)
        assert (gen.logprobs[gen.completion_mask == 0] == 0).all()
