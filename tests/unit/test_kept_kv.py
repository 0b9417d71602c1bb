"""The lean engine's KV cache kept between the turns of a rollout (``generation/kept.py``): episodes,
trees, game-state trees (branch by clone and by replay), episodes ending at different turns, two
stacked models and a budget that forces eviction all give the tokens and log-probs of re-reading
every history (fp32), while the cache is really used."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lit_marl.envs import make_env
from lit_marl.envs.base import register
from lit_marl.envs.game import Game, StepResult
from lit_marl.generation import Sampling, TorchEngine
from lit_marl.generation.kept import BLOCK, Kept, KeptCache
from lit_marl.rollout.episode import EpisodeSettings, run_episodes
from lit_marl.rollout.tree import TreeSettings, build_tree


class _Countdown(Game):
    """Episode ``task["turns"]`` ends after that many turns; each observation echoes the reply's
    length, so the histories differ between episodes."""

    def start(self, task):
        self.left, self.said = task["turns"], 0
        return [f"Room {task['turns']}: say anything ({k})." for k in range(self.num_agents)]

    def act(self, actions):
        self.left -= 1
        self.said += sum(len(a) for a in actions)
        info = {"won": self.left == 0, "lost": False, "score": min(self.said, 9), "max_score": 9}
        observations = [f"{self.left} to go; you said {len(a)} letters." for a in actions]
        return StepResult(observations, self.left == 0, info=info)


@register("countdown-kv")
class Countdown(_Countdown):
    cloneable = True


@register("countdown-kv-team")
class CountdownTeam(_Countdown):
    num_agents = 2
    cloneable = True


TASKS = [{"turns": t} for t in (1, 3, 4, 2)]  # episodes end at different turns


class Recording(TorchEngine):
    """Records every call's prompts (per model)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prompts = []

    def _decode(self, calls, *args, **kwargs):
        self.prompts.append([[list(p) for p in prompts] for _, prompts, _ in calls])
        return super()._decode(calls, *args, **kwargs)

    def history_tokens(self) -> int:
        """The tokens of the prompts and replies of each model's previous call that its next call's
        prompts start with: what a cache kept between calls need not compute again (at least)."""
        total = 0
        for before, after in zip(self.prompts, self.prompts[1:]):
            for old, new in zip(before, after):
                total += sum(max((len(p) for p in old if q[: len(p)] == p), default=0) for q in new)
        return total


def episodes(agents, env, settings, kept_kv_gib=4.0, seed=0, tasks=TASKS):
    engine = Recording(kept_kv_gib=kept_kv_gib)
    torch.manual_seed(seed)
    with engine.rollout(agents):
        batches = run_episodes(agents, tasks, make_env(env), settings, engine=engine)
        assert engine.kept is not None or not kept_kv_gib
    assert engine.kept is None  # freed with the block
    return batches, engine


def assert_same_episodes(kept, reread):
    for a, b in zip(kept, reread):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert b.num_turns.tolist() == [1, 3, 4, 2]
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("greedy", [True, False])
def test_episodes_with_the_kept_cache_are_the_reread_ones(tiny_agent, greedy):
    settings = EpisodeSettings(max_turns=4, sampling=Sampling(max_new_tokens=6, greedy=greedy))
    kept, engine = episodes([tiny_agent], "countdown-kv", settings)
    reread, off = episodes([tiny_agent], "countdown-kv", settings, kept_kv_gib=0)
    assert_same_episodes(kept, reread)
    assert off.prefill == [0, off.prefill[1]] and off.prefill[1] > 0
    reused, fed = engine.prefill
    assert fed + reused == off.prefill[1] and reused >= engine.history_tokens() > 0  # each history read once
    stats, off_stats = kept[0].stats, reread[0].stats  # the rollout reports it
    assert stats["perf/prompt_tokens_computed"] == fed and stats["perf/prompt_reused_frac"] == reused / (fed + reused)
    assert off_stats["perf/prompt_reused_frac"] == 0 and off_stats["perf/prompt_tokens_computed"] == off.prefill[1]


def test_two_stacked_models_keep_a_cache_each(tiny_agents):
    settings = EpisodeSettings(max_turns=4, sampling=Sampling(max_new_tokens=5, greedy=True))
    kept, engine = episodes(tiny_agents, "countdown-kv-team", settings)
    reread, _ = episodes(tiny_agents, "countdown-kv-team", settings, kept_kv_gib=0)
    assert_same_episodes(kept, reread)
    assert engine.prefill[0] >= engine.history_tokens() > 0


def test_a_budget_too_small_for_every_history_evicts_and_rereads(tiny_agent):
    settings = EpisodeSettings(max_turns=4, sampling=Sampling(max_new_tokens=6, greedy=True))
    full, engine = episodes([tiny_agent], "countdown-kv", settings)
    per_token = _token_bytes(tiny_agent)
    small, tight = episodes([tiny_agent], "countdown-kv", settings, kept_kv_gib=120 * per_token / 2**30)
    reread, _ = episodes([tiny_agent], "countdown-kv", settings, kept_kv_gib=0)
    assert_same_episodes(small, reread)
    assert_same_episodes(full, reread)
    assert 0 < tight.prefill[0] < engine.prefill[0]  # some histories kept, others read again


def _token_bytes(agent) -> int:
    c = agent.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4


def trees(agents, tasks, env, settings, kept_kv_gib=4.0):
    engine = Recording(kept_kv_gib=kept_kv_gib)
    torch.manual_seed(0)
    with engine.rollout(agents):
        batch = build_tree(agents, tasks, env, settings, engine=engine)
    return batch, engine


def assert_same_trees(a, b):
    assert a.completions == b.completions
    torch.testing.assert_close(a.rewards, b.rewards)
    for x, y in zip(a.agents, b.agents):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.completion_mask, y.completion_mask)
        torch.testing.assert_close(x.rollout_logprobs, y.rollout_logprobs, rtol=0, atol=2e-5)


@pytest.mark.parametrize("joint_mode, turns", [("aligned", 3), ("cross", 2)])
def test_trees_share_their_parents_cache(tiny_agents, joint_mode, turns):
    """A transition that extends each agent's history: every child extends its parent's sequence."""
    from helpers import LENGTH_REWARD, PLAIN, slogan_data

    data = slogan_data(reward_fn=LENGTH_REWARD, num_generations=2, num_turns=turns, transition=PLAIN,
                       joint_mode=joint_mode, sampling={"max_new_tokens": 6}, sampling_streams="per_task")  # fmt: skip
    settings = replace(data.tree, sampling_seed=3)
    kept, engine = trees(tiny_agents, data.train_tasks[:2], data.env, settings)
    reread, off = trees(tiny_agents, data.train_tasks[:2], data.env, settings, kept_kv_gib=0)
    assert_same_trees(kept, reread)
    assert engine.prefill[0] > 0 and sum(engine.prefill) == off.prefill[1]
    assert kept.stats["perf/prompt_tokens_computed"] == engine.prefill[1] and kept.stats["perf/prompt_reused_frac"] > 0


@pytest.mark.parametrize("branching", ["clone", "replay"])
def test_game_state_trees(tiny_agents, branching):
    env = make_env("countdown-kv-team")
    env.branching = branching
    settings = TreeSettings(num_generations=2, num_turns=3, sampling=Sampling(max_new_tokens=5, temperature=1.0))
    kept, engine = trees(tiny_agents, TASKS[1:3], env, settings)
    reread, _ = trees(tiny_agents, TASKS[1:3], env, settings, kept_kv_gib=0)
    assert_same_trees(kept, reread)
    assert engine.prefill[0] > 0  # the chat template's header at least


def test_nothing_is_reused_after_the_weights_change(tiny_agent):
    prompts = [list(range(3, 3 + 2 * BLOCK))]
    engine = TorchEngine()
    with engine.rollout([tiny_agent]):
        first = engine.generate(tiny_agent, prompts, 1, sampling=Sampling(max_new_tokens=4, greedy=True))
        again = [prompts[0] + first.completion_ids[0].tolist() + [5, 6]]
        engine.generate(tiny_agent, again, 1, sampling=Sampling(max_new_tokens=4, greedy=True))
        assert engine.prefill[0] >= 2 * BLOCK
        reused = engine.prefill[0]
        with torch.no_grad():
            next(tiny_agent.model.parameters()).add_(0.0)  # an in-place change, as an optimizer step
        engine.generate(tiny_agent, [again[0] + [7]], 1, sampling=Sampling(max_new_tokens=4, greedy=True))
        assert engine.prefill[0] == reused
    engine.generate(
        tiny_agent, prompts, 1, sampling=Sampling(max_new_tokens=4, greedy=True)
    )  # outside a block: nothing kept
    assert engine.kept is None


def test_lookup_finds_the_longest_verified_prefix():
    def kept(tokens):
        k = torch.arange(len(tokens), dtype=torch.float).view(1, 1, 1, -1, 1)
        return Kept(tokens, k, k.clone(), 0, ((0, len(tokens)),))

    cache = KeptCache(budget=10**9)
    a, b = list(range(40)), list(range(20)) + [99] * 20
    cache.put("m", (1,), [kept(a), kept(b)])
    matches = cache.take("m", (1,), [a + [1], b[:35] + [2, 3], [7] * 40, a[:10]])
    assert [(m[0].tokens if m[0] else None, m[1]) for m in matches] == [(a, 40), (b, 35), (None, 0), (None, 0)]
    cache.put("m", (1,), [kept(a)])
    assert cache.take("m", (2,), [a + [1]]) == [(None, 0)]  # other weights: nothing
    cache.put("m", (1,), [kept(a), kept(b)])
    (whole,) = cache.take("m", (1,), [a])
    assert whole[1] == 39  # a prompt's last token is always fed: its output samples
    small = KeptCache(budget=2 * kept(a).k.nbytes + 8)
    small.put("m", (1,), [kept(b), kept(a)])
    assert [e.tokens for e in small.stores["m"].entries] == [b]  # in order, while they fit


def test_a_sequence_is_read_across_its_slot_ranges():
    k = torch.arange(2 * 10, dtype=torch.float).view(1, 2, 1, 10, 1)  # two rows of 10 slots
    entry = Kept([1, 2, 3, 4, 5], k, -k, row=1, slots=((0, 0), (2, 4), (6, 9)))  # an empty range first
    out_k, out_v = torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1)
    entry.write(4, out_k, out_v)
    assert out_k.flatten().tolist() == [12, 13, 16, 17] and out_v.flatten().tolist() == [-12, -13, -16, -17]
    alone = entry.copy()
    assert alone.k.shape == (1, 1, 1, 5, 1) and alone.k.flatten().tolist() == [12, 13, 16, 17, 18]


@pytest.mark.parametrize("bf16", [False, True])
def test_kept_rollout_logprobs_agree_with_the_trainers_forward(tiny_agent, bf16):
    """The engine's log-probs of the tokens it sampled after a kept prefix against the training
    forward over the whole sequence: fp32 within today's 1e-4; under bf16 autocast within the gap
    re-reading shows (precision, not the cache)."""
    from lit_marl.logprobs import sequence_logprobs

    settings = EpisodeSettings(max_turns=4, sampling=Sampling(max_new_tokens=6, greedy=True))
    gaps = []
    for gib in (4.0, 0):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            (batch,), _ = episodes([tiny_agent], "countdown-kv", settings, kept_kv_gib=gib)
            with torch.no_grad():
                trainer = sequence_logprobs(tiny_agent.model, batch.input_ids, batch.attention_mask)
        sampled = batch.loss_mask.bool()
        gaps.append((trainer - batch.rollout_logprobs)[sampled].abs())
    kept, reread = gaps
    if bf16:
        assert kept.mean() <= 1.5 * reread.mean() + 1e-3 and kept.max() <= 1.5 * reread.max() + 1e-2
    else:
        assert kept.max() < 1e-4 and reread.max() < 1e-4


def test_cache_slots_never_written_cannot_poison_a_row(tiny_agent, monkeypatch):
    """Rows keep prefixes of different lengths, so a row's slots left of its own are never written;
    memory that happens to hold NaN there (``torch.empty``) must not reach its scores."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return (
            empty(*args, **kwargs).fill_(float("nan"))
            if kwargs.get("dtype", torch.float).is_floating_point
            else empty(*args, **kwargs)
        )

    settings = EpisodeSettings(max_turns=3, sampling=Sampling(max_new_tokens=6, greedy=True))
    tasks = [{"turns": t} for t in (3, 40, 500, 6000)]  # prompts, so kept prefixes, of different lengths
    monkeypatch.setattr(torch, "empty", poisoned)
    kept, engine = episodes([tiny_agent], "countdown-kv", settings, tasks=tasks)
    monkeypatch.undo()
    reread, _ = episodes([tiny_agent], "countdown-kv", settings, kept_kv_gib=0, tasks=tasks)
    assert engine.prefill[0] > 0 and len({len(p) for p in engine.prompts[1][0]}) > 1
    for a, b in zip(kept, reread):
        assert torch.equal(a.input_ids, b.input_ids)
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=2e-5)
