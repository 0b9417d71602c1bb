"""The vllm_server engine against real vLLM servers (its CPU build, ``make test-vllm``), each started by
the engine on localhost and fed the trainer's weights through the ``lit_marl_gloo`` transfer backend
(vLLM 0.32's four phases; its own NCCL and IPC backends need a GPU).

On SmolLM2 (fp32): greedy rows through the server equal the colocated vLLM engine's token for token,
and the server's log-probs the trainer's forward within the colocated engine's tolerance; after each of
3 optimizer steps and syncs they still do, while a server left with the old weights (the sync skipped)
does not; tensor parallelism over 2 processes gives the same tokens as 1; a server killed mid-rollout
is named within the request's timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm_engine import OPTIONS, TEXTS, encode, trainer_logprobs, update  # noqa: E402

from lit_marl.agents import Agent  # noqa: E402
from lit_marl.generation import Sampling, make_engine  # noqa: E402
from lit_marl.generation.server_http import ServerError  # noqa: E402
from lit_marl.generation.weights import weight_version  # noqa: E402

GREEDY = Sampling(max_new_tokens=16, greedy=True)
SERVER = {"server_args": {"max_model_len": 2048, "max_num_seqs": 16}, "timeout_s": 120.0}


def rows(gen) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(gen.completion_ids, gen.completion_mask)]


def served(engine, agent, prompts, sampling=GREEDY):
    with engine.rollout([agent]):
        return engine.generate(agent, prompts, 1, sampling)


@pytest.fixture(scope="module")
def smollm2() -> Agent:
    return Agent("smollm2-135m-instruct")


def test_server_rows_equal_the_colocated_engines_through_three_updates(smollm2, tmp_path):
    agent = Agent("smollm2-135m-instruct")
    server = make_engine("vllm_server", {**SERVER, "log_dir": str(tmp_path)})
    colocated = make_engine("vllm", OPTIONS)
    prompts = encode(agent, TEXTS)
    try:
        for step in range(4):
            if step:
                update(agent, steps=1)
            ours = served(server, agent, prompts)
            theirs = served(colocated, agent, prompts)
            assert rows(ours) == rows(theirs), f"after {step} updates"
            assert float((ours.logprobs - trainer_logprobs(agent, ours)).abs().max()) < 2e-3
        assert server.syncs == 4
        sampled = server.generate(agent, prompts[:2], 3, Sampling(max_new_tokens=12, temperature=0.8, top_p=0.9))
        assert sampled.completion_ids.shape[0] == 6
        assert float((sampled.logprobs - trainer_logprobs(agent, sampled)).abs().max()) < 2e-3
        # 3680 prompt tokens, more than a batch's budget (2048), every request seeded: with chunked prefill
        # vLLM's CPU build rewinds a partly prefilled request's generator, cannot, and its engine dies
        many = server.generate(agent, [p * 40 for p in prompts] * 2, 1, Sampling(max_new_tokens=4, temperature=0.8))
        assert many.completion_ids.shape[0] == 16
        # the negative control: an update the server is not sent (its version marked as current)
        before = rows(theirs)
        update(agent, steps=3)
        next(iter(server.servers.values())).version = weight_version(agent.model)
        stale, fresh = served(server, agent, prompts), served(colocated, agent, prompts)
        assert rows(fresh) != before, "the updates changed no greedy row: the control is void"
        assert rows(stale) == before and rows(stale) != rows(fresh)
    finally:
        server.close()


def test_tensor_parallel_servers_give_the_same_tokens(tmp_path):
    """TP=2 (two worker processes, each receiving every tensor and keeping its shard) samples the tokens
    TP=1 does, with the same log-probs. On the tiny model: SmolLM2's 9 attention heads do not split in 2."""
    agent = Agent("tiny-random")
    prompts = [[5, 17, 33, 101], [7, 8, 9], [300, 301, 302, 303, 304], [11, 12]]
    outputs = []
    for tp in (1, 2):
        engine = make_engine("vllm_server", {**SERVER, "tensor_parallel_size": tp, "log_dir": str(tmp_path)})
        try:
            outputs.append(served(engine, agent, prompts))
            assert next(iter(engine.servers.values())).client.world_size() == tp
        finally:
            engine.close()
    assert rows(outputs[0]) == rows(outputs[1])
    assert float((outputs[0].logprobs - outputs[1].logprobs).abs().max()) < 1e-4
    assert float((outputs[1].logprobs - trainer_logprobs(agent, outputs[1])).abs().max()) < 2e-3


def test_a_lora_team_on_one_base_is_served_as_runtime_adapters(tmp_path):
    """Two agents as LoRA adapters on one base: one server (the base sent once by the transfer protocol),
    each adapter loaded by path at run time and named by its agent's requests; greedy rows equal the
    colocated engine's (its instance applies the same adapters) and follow each agent's policy, also after
    agent 0's adapter changed and was loaded again in place."""
    from helpers import lora_team

    agents = lora_team(Agent("tiny-random").model, "tiny-random", Agent("tiny-random").tokenizer)
    shared = agents[0].model.shared
    prompts = [[5, 17, 33, 101], [7, 8, 9], [300, 301, 302, 303, 304], [11, 12]]
    server = make_engine("vllm_server", {**SERVER, "log_dir": str(tmp_path)})
    colocated = make_engine("vllm", OPTIONS)
    try:
        for change in range(2):
            if change:
                with torch.no_grad():
                    for name, p in shared.named_parameters():
                        if "lora_B" in name and ".agent0." in name:
                            p.add_(torch.randn_like(p))
            outputs = []
            for agent in agents:
                ours, theirs = served(server, agent, prompts), served(colocated, agent, prompts)
                assert rows(ours) == rows(theirs), f"{agent.model.adapter} after {change} changes"
                assert float((ours.logprobs - trainer_logprobs(agent, ours)).abs().max()) < 2e-3
                outputs.append(rows(ours))
            assert outputs[0] != outputs[1], "the two adapters decode alike: the check is void"
        assert len(server.servers) == 1 and server.syncs == 1 and server.adapter_syncs == 3
    finally:
        server.close()


def test_a_server_killed_mid_rollout_is_named_within_the_timeout(smollm2, tmp_path):
    engine = make_engine("vllm_server", {**SERVER, "timeout_s": 60.0, "log_dir": str(tmp_path)})
    prompts = encode(smollm2, TEXTS * 8)
    try:
        served(engine, smollm2, prompts[:1])  # started, weights sent
        process = next(iter(engine.servers.values())).process
        threading.Timer(2.0, process.process.kill).start()
        started = time.monotonic()
        with pytest.raises(ServerError, match=rf"(?s){process.url}.*exited with code -9"):
            engine.generate(smollm2, prompts, 1, Sampling(max_new_tokens=512, temperature=1.0))
        assert time.monotonic() - started < 60
    finally:
        engine.close()
