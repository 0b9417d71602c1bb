"""Iterative preference training, the pure parts: index-aligned pairs against a comparator, replay
weights and draws from shards on disk, and the HTTP comparator against a server on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch

from helpers import comparator_server
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.envs.centralized import TaggedAdapter
from lit_marl.generation import Sampling
from lit_marl.generation.api import ApiError, ApiSettings, ApiWriter
from lit_marl.generation.text import TextEngine, TextRole, _tokens
from lit_marl.rollout.batch import AgentSamples
from lit_marl.rollout.pairs import PreferenceSamples, comparison_pairs
from lit_marl.rollout.replay import PreferenceReplay, ReplaySettings, replay_weights


# --------------------------------------------------------------------------- pairs
def test_comparison_pairs_by_index_with_ties_and_nan_dropped():
    target = torch.tensor([1.0, 0.0, 0.5, 0.7, float("nan")])
    comparator = torch.tensor([0.0, 1.0, 0.5, 0.2, 0.0])
    # k=0 target wins (gap 1), k=1 comparator wins (gap 1, comparator reward 1), k=2 tie, k=3 target (gap .5)
    assert comparison_pairs(target, comparator, "comparator_reward", None) == [(1, False), (3, True), (0, True)]
    assert comparison_pairs(target, comparator, "reward_gap", None) == [(0, True), (1, False), (3, True)]
    assert comparison_pairs(target, comparator, "all", None) == [(0, True), (1, False), (3, True)]
    assert comparison_pairs(target, comparator, "comparator_reward", 2) == [(1, False), (3, True)]
    draws = [comparison_pairs(target, comparator, "random", 2, torch.Generator().manual_seed(s)) for s in range(8)]
    assert draws[0] == comparison_pairs(target, comparator, "random", 2, torch.Generator().manual_seed(0))
    assert len({tuple(d) for d in draws}) > 1 and all(len(d) == 2 for d in draws)
    with pytest.raises(ValueError, match=r"max_pairs must be None \(model.pairs.per_task: null\)"):
        comparison_pairs(target, comparator, "all", 4)


def _rows(rewards: list[float], width: int = 3) -> PreferenceSamples:
    """Pairs whose chosen reward is ``rewards[p]`` (and whose first completion token is p)."""
    n = len(rewards)
    ids = torch.arange(2 * n).repeat_interleave(1).view(-1, 1).repeat(1, width)
    samples = AgentSamples(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.ones(2 * n, 1, dtype=torch.long),
        returns=torch.zeros(2 * n),
        group_ids=torch.arange(n).repeat_interleave(2),
        turn_ids=torch.zeros(2 * n, dtype=torch.long),
    )
    r = torch.tensor(rewards)
    return PreferenceSamples([samples], r, r - 1, torch.ones(n, dtype=torch.bool))


# --------------------------------------------------------------------------- replay
def test_replay_weights_by_hand():
    assert replay_weights([2, 1, 0], "current") == [0, 0, 1]
    assert replay_weights([2, 1, 0], "nearest_k", k=2) == [0, 0.5, 0.5]
    assert replay_weights([2, 1, 0], "all_history") == pytest.approx([1 / 3] * 3)
    # (1 - l) l^age for l = 0.5: .125, .25, .5, normalised by .875
    assert replay_weights([2, 1, 0], "lambda_decay", lam=0.5) == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    assert replay_weights([2, 1, 0], "lambda_decay", lam=1.0) == pytest.approx([1 / 3] * 3)
    assert replay_weights([2, 1, 0], "lambda_decay", lam=0.0) == [0, 0, 1]


def test_replay_draws_only_from_eligible_iterations_and_survives_reload(tmp_path):
    replay = PreferenceReplay(tmp_path, 0, ReplaySettings("nearest_k", k=2), pad_ids=[0])
    for iteration in range(3):  # iteration i's pairs carry reward 10 i + p
        replay.write(iteration, iteration, _rows([10.0 * iteration + p for p in range(4)]))
    fresh = _rows([20.0, 21.0, 22.0, 23.0])
    drawn = replay.draw(2, fresh, torch.Generator().manual_seed(0))
    assert len(drawn) == 4  # default size: the step's new pairs
    assert all(r >= 10 for r in drawn.chosen_rewards.tolist())  # iteration 0 is 2 old: not in nearest 2
    big = PreferenceReplay(tmp_path, 0, ReplaySettings("all_history", sample_size=400), pad_ids=[0])
    big.load_state_dict(replay.state_dict())  # a resumed run: the shards from disk
    rewards = big.draw(2, fresh, torch.Generator().manual_seed(0)).chosen_rewards
    per_iteration = torch.bincount((rewards // 10).long(), minlength=3)
    assert len(rewards) == 400 and (per_iteration > 100).all()  # equal weights per shard
    # rows travel with their rewards: a pair's chosen row starts with token 2p of its shard
    assert torch.equal(drawn.agents[0].input_ids[0::2, 0] // 2, (drawn.chosen_rewards % 10).long())


def test_lambda_decay_favours_new_iterations(tmp_path):
    replay = PreferenceReplay(tmp_path, 0, ReplaySettings("lambda_decay", lam=0.5, sample_size=700), pad_ids=[0])
    for iteration in range(3):
        replay.write(iteration, iteration, _rows([10.0 * iteration + p for p in range(4)]))
    rewards = replay.draw(2, _rows([20.0]), torch.Generator().manual_seed(1)).chosen_rewards
    share = torch.bincount((rewards // 10).long(), minlength=3).double() / len(rewards)
    torch.testing.assert_close(share, torch.tensor([1 / 7, 2 / 7, 4 / 7], dtype=torch.double), atol=0.05, rtol=0)


def test_replay_checks_its_settings_and_files(tmp_path):
    with pytest.raises(ConfigError, match="needs model.preference_replay_k"):
        ReplaySettings("nearest_k")
    with pytest.raises(ConfigError, match="preference_replay_lambda=0.5 is for preference_replay_mode: lambda_decay"):
        ReplaySettings("all_history", lam=0.5)
    with pytest.raises(ConfigError, match="preference_replay_sample_size is for the replay modes"):
        ReplaySettings("current", sample_size=3)
    replay = PreferenceReplay(tmp_path, 0, ReplaySettings("all_history"), pad_ids=[0])
    replay.write(0, 0, _rows([1.0]))
    assert [p.name for p in (tmp_path / "rank0").iterdir()] == ["iteration_0000_step_000000.pt"]  # no partial file
    state = replay.state_dict()
    (tmp_path / "rank0" / "iteration_0000_step_000000.pt").unlink()
    with pytest.raises(ConfigError, match="preference replay shards are missing"):
        PreferenceReplay(tmp_path, 0, ReplaySettings("all_history"), pad_ids=[0]).load_state_dict(state)


# --------------------------------------------------------------------------- the HTTP comparator
@pytest.fixture(scope="module")
def server():
    with comparator_server() as httpd:
        yield httpd


@pytest.fixture(scope="module")
def agent():
    return Agent("tiny-random")


def _generate(server, agent, path, top_k=None, **settings):
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    engine = TextEngine(ApiWriter(ApiSettings(url=url, **settings)))
    tasks = [{"topic": "tea"}, {"topic": "snow"}]
    role = TextRole(agent, 1, tasks)
    prompts = [role.encode_prompt(f"slogan for {t['topic']}") for t in tasks]
    sampling = Sampling(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=top_k)
    return engine, engine.generate_team([(role, prompts, 3)], sampling)[0]


def test_generic_format(server, agent, monkeypatch):
    monkeypatch.setenv("TEST_KEY", "sekret")
    server.seen.clear()
    engine, gen = _generate(server, agent, "/generic", response_field="out.texts", key_env="TEST_KEY")
    path, headers, body = server.seen[0]
    assert body["prompt"] == "slogan for tea" and body["agent_idx"] == 1 and body["num_return_sequences"] == 3
    assert body["batch_item"] == {"topic": "tea"} and body["temperature"] == 0.7 and body["max_new_tokens"] == 16
    assert body["top_p"] == 0.9 and body["top_k"] is None  # CoMLRL's payload: top_k null when off
    assert headers["authorization"] == "Bearer sekret"
    texts = agent.decode(gen.completion_ids, gen.completion_mask)
    assert texts == ["1:0", "1:1", "1:2"] * 2 and gen.completion_ids.shape[0] == 6
    ends = gen.completion_ids.gather(1, (gen.completion_mask.sum(1, keepdim=True) - 1))
    assert (ends == agent.eos_token_id).all()  # closed by the policy's end token, as its own samples
    assert engine.skipped == {1: []} and engine.writer.calls == 2


def test_openai_and_anthropic_formats(server, agent, monkeypatch):
    server.seen.clear()
    _, gen = _generate(server, agent, "/openai", format="openai_chat", model="gpt-x")
    body = server.seen[0][2]
    assert body["messages"] == [{"role": "user", "content": "slogan for tea"}] and body["n"] == 3
    assert body["model"] == "gpt-x" and body["max_tokens"] == 16 and "top_k" not in body
    assert agent.decode(gen.completion_ids, gen.completion_mask)[:3] == ["chat 0", "chat 1", "chat 2"]
    monkeypatch.setenv("TEST_KEY", "k2")
    server.seen.clear()
    engine, gen = _generate(server, agent, "/anthropic", format="anthropic", model="claude-x", key_env="TEST_KEY")
    assert engine.writer.calls == 6  # no n: one request per candidate
    path, headers, body = server.seen[0]
    assert headers["anthropic-version"] == "2023-06-01" and headers["x-api-key"] == "k2"
    assert body["model"] == "claude-x" and body["max_tokens"] == 16 and "n" not in body and "top_k" not in body


@pytest.mark.parametrize(
    "path, settings",
    [
        ("/generic", {"response_field": "out.texts"}),
        ("/openai", {"format": "openai_chat", "model": "gpt-x"}),
        ("/anthropic", {"format": "anthropic", "model": "claude-x"}),
    ],
)
def test_every_format_sends_top_k_when_on(server, agent, path, settings):
    server.seen.clear()
    _generate(server, agent, path, top_k=7, **settings)
    body = server.seen[0][2]
    assert (body["top_k"], body["top_p"], body["temperature"]) == (7, 0.9, 0.7)


def test_timeouts_are_counted_skips_and_garbage_is_an_error(server, agent):
    engine, gen = _generate(server, agent, "/slow", timeout_s=0.2)
    assert engine.skipped == {1: [0, 1, 2, 3, 4, 5]} and gen.completion_ids.shape[0] == 6
    with pytest.raises(ApiError, match="did not answer JSON"):
        _generate(server, agent, "/garbage")
    with pytest.raises(ApiError, match="402 Payment Required"):
        _generate(server, agent, "/402")
    with pytest.raises(ApiError, match=r"returned 1 texts at completions for 3 asked"):
        _generate(server, agent, "/short")
    with pytest.raises(ApiError, match=r"no list of texts at 'completions'"):
        _generate(server, agent, "/openai")  # a chat reply read as the generic format
    with pytest.raises(ApiError, match="TEST_MISSING_KEY"):
        _generate(server, agent, "/generic", key_env="TEST_MISSING_KEY")
    with pytest.raises(ValueError, match="comparator_api.format=openai_chat: set model.comparator_api.model"):
        ApiSettings(url="http://127.0.0.1:1/x", format="openai_chat")


def test_long_texts_are_cut_without_an_end_token(server, agent):
    role = TextRole(agent, 0, [{}])
    ids = _tokens(role, "word " * 40, max_new_tokens=5)
    assert len(ids) == 5 and agent.eos_token_id not in ids


# --------------------------------------------------------------------------- centralized comparators
class ScriptedWriter:
    """A writer whose texts are a function of the prompt; records every ask."""

    def __init__(self, answer):
        self.answer, self.asks = answer, []

    def complete(self, prompts, role, tasks, n, sampling):
        self.asks.append((list(prompts), role, n, sampling.max_new_tokens))
        return [[self.answer(p, role, k) for k in range(n)] for p in prompts]


def _team(agent, engine, n=3):
    tasks = [{"topic": "tea"}, {"topic": "snow"}]
    roles = [TextRole(agent, i, tasks) for i in range(2)]
    calls = [(r, [r.encode_prompt(f"role {r.role} slogan for {t['topic']}") for t in tasks], n) for r in roles]
    gens = engine.generate_team(calls, sampling=Sampling(max_new_tokens=16))
    return [agent.decode(g.completion_ids, g.completion_mask) for g in gens], gens


def test_centralized_generation_splits_joint_texts_and_skips_unparseable_ones(agent):
    def joint(prompt, role, k):  # candidate 1 of every task lacks agent 1's section
        topic = "tea" if "for tea" in prompt else "snow"
        tail = "" if k == 1 else f"<agent_1> {topic} two {k} </agent_1>"
        return f"<agent_0> {topic} one {k} </agent_0> {tail}"

    writer = ScriptedWriter(joint)
    engine = TextEngine(writer, "centralized", TaggedAdapter(), centralized_index=1)
    texts, gens = _team(agent, engine)
    (asked, role, n, budget) = writer.asks[0]
    assert len(writer.asks) == 1 and role == 1 and n == 3 and budget == 32  # one call; every role's budget
    assert "role 0 slogan for tea" in asked[0] and "role 1 slogan for tea" in asked[0] and len(asked) == 2
    assert texts[0][:3] == ["tea one 0", "", "tea one 2"] and texts[1][3:] == ["snow two 0", "", "snow two 2"]
    assert engine.skipped == {0: [1, 4], 1: [1, 4]}  # the joint candidate is skipped for every role
    assert gens[0].prompt_ids.shape[0] == 6  # the rows answer the policy's own prompts


def test_sequential_generation_shows_earlier_outputs(agent):
    def reply(prompt, role, k):
        if role == 0:
            return "no tags" if "for snow" in prompt else "<agent_0> first </agent_0>"
        return "<agent_1> saw first </agent_1>" if "first" in prompt else "<agent_1> saw nothing </agent_1>"

    writer = ScriptedWriter(reply)
    engine = TextEngine(writer, "centralized_sequential", TaggedAdapter())
    texts, _ = _team(agent, engine)
    assert [len(a[0]) for a in writer.asks] == [6, 3]  # role 1 is asked only where role 0 parsed (tea)
    assert all(n == 1 for _, _, n, _ in writer.asks)
    assert texts[0][:3] == ["first"] * 3 and texts[1][:3] == ["saw first"] * 3
    assert engine.skipped == {0: [3, 4, 5], 1: [3, 4, 5]}
    prompt = TaggedAdapter().build_sequential_prompt({}, ["p0", "p1"], 1, ["line one"])
    assert "Agent 1 prompt:\np1" in prompt and "<agent_0>\nline one\n</agent_0>" in prompt
