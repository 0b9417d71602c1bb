"""The vLLM engine against real vLLM (its CPU build, ``make vllm``): ``make test-vllm``.

Greedy outputs equal the lean decoder's token for token on SmolLM2 (fp32) and vLLM's log-probs
equal the trainer's forward; after optimizer steps vLLM serves the new weights, also for prompts
that share a prefix with earlier ones (the prefix cache is emptied at every sync: without that,
rows are decoded from keys and values of the old weights, which the last test shows); repeated
syncs do not grow memory; LoRA agents on one base share one instance, each its adapter; starting vLLM
leaves the run's random state. Fits with vLLM rollouts: ``test_fits.py``."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from lit_marl.agents import Agent  # noqa: E402
from lit_marl.generation import Sampling, make_engine  # noqa: E402
from lit_marl.logprobs import completion_logprobs  # noqa: E402

TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colors:",
    "def add(a, b):",
    "Once upon a time",
    "2 + 2 =",
    "Translate 'cat' to French:",
    "The three primary colors are",
]
# a long shared opening (~330 tokens: two of the CPU backend's 128-token cache blocks; a GPU's are 16),
# then different endings
PREFIX = (
    " ".join(
        f"Rule {i}: read the question, think about what is asked, and answer in one short sentence." for i in range(16)
    )
    + " Question: "
)


# every test here starts its own instances in this process: a small KV budget each (8 prompts of
# ~350 tokens need ~160 MiB for SmolLM2) keeps the process well within the machine; vLLM wants room
# for one request of the longest length, so that is cut from SmolLM2's 8192 too
OPTIONS = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048}


@pytest.fixture(scope="module")
def smollm2() -> Agent:
    return Agent("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def _collect_engines():
    yield
    gc.collect()  # the instances of the test that ended


def encode(agent: Agent, texts: list[str]) -> list[list[int]]:
    return [agent.tokenizer(t)["input_ids"] for t in texts]


def trainer_logprobs(agent: Agent, gen) -> torch.Tensor:
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    with torch.no_grad():
        return completion_logprobs(agent.model, ids, mask, gen.completion_ids.shape[1]) * gen.completion_mask


def agreement(engine, agent, prompts, new=16) -> tuple[int, float]:
    """Rows whose greedy output equals the lean decoder's, and the largest |log p| difference
    between vLLM's log-probs and the trainer's forward on vLLM's tokens."""
    ours = engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=new, greedy=True))
    lean = make_engine("torch").generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=new, greedy=True))
    equal = sum(
        torch.equal(a[m.bool()], b[n.bool()])
        for a, m, b, n in zip(ours.completion_ids, ours.completion_mask, lean.completion_ids, lean.completion_mask)
    )
    return equal, float((ours.logprobs - trainer_logprobs(agent, ours)).abs().max())


def update(agent: Agent, steps: int = 3, lr: float = 3e-4) -> None:
    """AdamW steps on the likelihood of a sentence: the weights change as training changes them."""
    optimizer = torch.optim.AdamW(agent.model.parameters(), lr=lr)
    ids = torch.tensor(encode(agent, ["Paris is lovely. The answer is always forty-two, my friend."]))
    for _ in range(steps):
        out = agent.model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_greedy_outputs_and_log_probs_equal_the_lean_decoders(smollm2):
    engine = make_engine("vllm", OPTIONS)
    equal, diff = agreement(engine, smollm2, encode(smollm2, TEXTS))
    assert equal == len(TEXTS)
    assert diff < 2e-3
    sampled = engine.generate(
        smollm2, encode(smollm2, TEXTS[:2]), 3, sampling=Sampling(max_new_tokens=12, temperature=0.8, top_p=0.9)
    )
    assert sampled.completion_ids.shape[0] == 6 and sampled.logprobs is not None
    assert float((sampled.logprobs - trainer_logprobs(smollm2, sampled)).abs().max()) < 2e-3


def test_after_updates_vllm_serves_the_new_weights_also_for_cached_prefixes():
    agent = Agent("smollm2-135m-instruct")
    engine = make_engine("vllm", OPTIONS)
    first = encode(agent, [PREFIX + t for t in TEXTS])
    assert agreement(engine, agent, first)[0] == len(TEXTS)  # the prefix is now in vLLM's cache
    before = (
        make_engine("torch").generate(agent, first, 1, sampling=Sampling(max_new_tokens=16, greedy=True)).completion_ids
    )
    update(agent)
    after = (
        make_engine("torch").generate(agent, first, 1, sampling=Sampling(max_new_tokens=16, greedy=True)).completion_ids
    )
    assert not torch.equal(before, after), "the update changed no greedy output: the check is void"
    again = encode(agent, [PREFIX + t + " Be brief." for t in TEXTS])
    for prompts in (first, again):
        equal, diff = agreement(engine, agent, prompts)
        assert equal == len(TEXTS) and diff < 2e-3
    assert engine.syncs == 2


def test_starting_vllm_leaves_the_runs_random_state(smollm2):
    """vLLM seeds the global generators when it starts in this process; the run's streams go on as
    if it had not (sampling afterwards draws from them, as the lean decoder does)."""
    import random

    import numpy as np

    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    engine = make_engine("vllm", OPTIONS)
    engine.sync(smollm2)  # starts vLLM and loads the weights, nothing sampled
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def _rss_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def test_repeated_syncs_do_not_grow_memory(smollm2):
    engine = make_engine("vllm", OPTIONS)
    prompts = encode(smollm2, TEXTS[:4])
    sizes = []
    for _ in range(6):
        with torch.no_grad():
            smollm2.model.model.norm.weight.add_(1e-3)  # a new version: the next generate syncs
        engine.generate(smollm2, prompts, 1, sampling=Sampling(max_new_tokens=8, greedy=True))
        sizes.append(_rss_mib())
    assert engine.syncs == 6
    # the first syncs settle vLLM's and the allocator's pools; after that no growth per sync
    assert sizes[-1] - sizes[2] < 64, sizes


def test_lora_agents_on_one_base_share_one_instance_each_with_its_adapter():
    """Two agents as LoRA adapters on one base: one vLLM instance (the base loaded once), each agent's
    requests name its adapter; greedy outputs and log-probs follow each agent's own policy, and
    differ between the two."""
    from helpers import lora_team

    agents = lora_team(Agent("tiny-random").model, "tiny-random", Agent("tiny-random").tokenizer)
    engine = make_engine("vllm", OPTIONS)
    prompts = encode(agents[0], ["def f(x):", "x = [1, 2"])
    outputs = []
    for agent in agents:
        equal, diff = agreement(engine, agent, prompts, new=10)
        assert equal == len(prompts) and diff < 2e-3
        outputs.append(
            engine.generate(agent, prompts, 1, sampling=Sampling(max_new_tokens=10, greedy=True)).completion_ids
        )
    assert len(engine.backends) == 1 and engine.syncs == 1 and engine.adapter_syncs == 2
    assert not torch.equal(*outputs)


def test_without_emptying_the_prefix_cache_rows_would_come_from_old_weights():
    """The check above has the power to fail: with the cache reset disabled, a sync leaves rows whose
    prompts share a cached prefix decoded from the old weights' keys and values."""
    agent = Agent("smollm2-135m-instruct")
    engine = make_engine("vllm", OPTIONS)
    first = encode(agent, [PREFIX + t for t in TEXTS])
    engine.generate(agent, first, 1, sampling=Sampling(max_new_tokens=16, greedy=True))
    backend = engine.backends[id(agent.model)]
    backend.llm.reset_prefix_cache = lambda *a, **k: True  # what the engine did before
    update(agent, steps=3, lr=1e-3)
    equal, diff = agreement(engine, agent, encode(agent, [PREFIX + t + " Be brief." for t in TEXTS]))
    assert equal < len(TEXTS) or diff > 1e-2
