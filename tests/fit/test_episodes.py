"""Multi-turn episodes: the env protocol, the Corridor game, token-in/token-out trajectories, budgets,
and tiny-model fits of PPO (value head and separate critic), GRPO and RLOO."""

from __future__ import annotations

import json
from dataclasses import replace

import lightning as L
import pytest
import torch

from helpers import REPO_ROOT, make_trainer
from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.algorithms import GRPO, PPO, RLOO
from lit_marl.data import EpisodeDataModule, RolloutDataModule
from lit_marl.envs import make_env
from lit_marl.envs.base import REGISTRY, register
from lit_marl.envs.corridor import expert_actions, parse_command
from lit_marl.envs.game import Game, StepResult
from lit_marl.generation import Sampling
from lit_marl.models import cache_dir
from lit_marl.returns import anchor_groups
from lit_marl.rollout.episode import EpisodeSettings, run_episodes

CORRIDOR = REPO_ROOT / "data" / "corridor"


@register("letter-count")
class LetterCount(Game):
    """A test game whose score is the number of 'e' in the replies so far (capped): random text
    gets different scores, so group baselines have something to compare."""

    def start(self, task):
        self.score, self.steps = 0, 0
        return [f"Say something with many e's ({task['task_id']})."]

    def act(self, actions):
        self.steps += 1
        self.score = min(self.score + actions[0].count("e"), 9)
        return StepResult(
            [f"You have {self.score} points."],
            info={"won": self.score >= 9, "lost": False, "score": self.score, "max_score": 9},
        )


@register("two-letters")
class TwoLetters(Game):
    """A two-agent test game: agent 0 scores the 'e' it writes, agent 1 the 'a'; the team's score is
    the sum (capped). Each agent sees its own observation."""

    num_agents = 2

    def start(self, task):
        self.score = 0
        return ["Write many e's.", "Write many a's."]

    def act(self, actions):
        counts = [actions[0].count("e"), actions[1].count("a")]
        self.score = min(self.score + sum(counts), 12)
        info = {"won": self.score >= 12, "lost": False, "score": self.score, "max_score": 12}
        return StepResult([f"You wrote {counts[0]} e's.", f"You wrote {counts[1]} a's."], info=info)


# --------------------------------------------------------------------------- the game
def test_corridor_expert_wins_and_the_pit_loses():
    for task in ({"length": 4, "key_room": 2}, {"length": 5, "key_room": 3, "pit": True}):
        env = make_env("corridor")
        env.start(task)
        scores = []
        for action in expert_actions(task):
            result = env.act([f"I will {action} now."])
            scores.append(result.info["score"])
        assert result.terminated and result.info["won"] and scores[-1] == 3 and sorted(scores) == scores
    env = make_env("corridor")
    env.start({"length": 4, "key_room": 2, "pit": True})
    result = env.act(["west"])
    assert result.terminated and result.info["lost"] and not result.info["won"]


def test_corridor_truncates_and_clones():
    env = make_env("corridor")
    env.start({"length": 3, "key_room": 1, "max_steps": 2})
    assert not env.act(["dance"]).truncated
    copy = env.clone()
    assert env.act(["dance"]).truncated
    assert copy.act(["east"]).info["score"] == 0 and copy.room == 1 and env.room == 0


def test_parse_command_takes_the_first():
    assert parse_command("Let me go east, then take key") == "east"
    assert parse_command("TAKE KEY!") == "take key"
    assert parse_command("eastward ho") is None


def test_registry_errors():
    with pytest.raises(ConfigError, match=r"data\.env='maze'.*corridor"):
        make_env("maze")
    with pytest.raises(ConfigError, match=r"do not fit environment 'corridor'"):
        make_env("corridor", {"walls": 3})
    with pytest.raises(ValueError, match="taken"):
        register("corridor")(LetterCount)
    assert REGISTRY["letter-count"] is LetterCount


def test_an_env_by_import_path_needs_no_registration():
    env = make_env("lit_marl.envs.corridor:Corridor", {"instructions": False})
    assert type(env).__name__ == "Corridor"
    with pytest.raises(ConfigError, match=r"data\.env='lit_marl\.envs\.base:Steps' is not a subclass"):
        make_env("lit_marl.envs.base:Steps")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        make_env("no_such_module:Env")


# --------------------------------------------------------------------------- token-in / token-out
@pytest.fixture(scope="module")
def agent():
    return Agent("tiny-random")


def test_training_ids_are_exactly_what_generation_saw_and_produced(agent):
    from helpers import RecordingEngine

    engine = RecordingEngine()
    torch.manual_seed(0)
    tasks = [{"length": 5, "key_room": 3}, {"length": 6, "key_room": 2}]
    settings = EpisodeSettings(group_size=1, max_turns=3, sampling=Sampling(max_new_tokens=6))
    (batch,) = run_episodes([agent], tasks, make_env("corridor"), settings, engine=engine)
    calls = [(prompts, out) for _, prompts, out in engine.calls]
    assert len(calls) == 3 and batch.num_turns.tolist() == [3, 3]
    for row in range(2):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        loss_mask = batch.loss_mask[row][batch.attention_mask[row].bool()].tolist()
        sampled = []
        for prompts, out in calls:
            seen = prompts[row]
            produced = out.completion_ids[row][out.completion_mask[row].bool()].tolist()
            assert ids[: len(seen)] == seen  # the context of every turn is a prefix of the trajectory
            assert ids[len(seen) : len(seen) + len(produced)] == produced  # then what it produced
            assert loss_mask[len(seen) : len(seen) + len(produced)] == [1] * len(produced)
            sampled += list(range(len(seen), len(seen) + len(produced)))
        # the loss mask is exactly the sampled tokens: no prompt, observation or template token
        assert [i for i, m in enumerate(loss_mask) if m] == sampled
        assert (
            ids
            == calls[-1][0][row] + calls[-1][1].completion_ids[row][calls[-1][1].completion_mask[row].bool()].tolist()
        )
    # observations are the template's segments: the decoded text is a well-formed ChatML dialogue
    text = agent.tokenizer.decode(batch.input_ids[0][batch.attention_mask[0].bool()])
    assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
    assert text.count("<|im_end|>") == 5  # 3 user messages + 2 closed replies (the last one trails)


def test_reply_cut_by_the_budget_is_closed_by_the_next_segment(agent):
    torch.manual_seed(1)
    settings = EpisodeSettings(max_turns=2, sampling=Sampling(max_new_tokens=3))
    (batch,) = run_episodes([agent], [{"length": 4, "key_room": 2}], make_env("corridor"), settings)
    ids = batch.input_ids[0].tolist()
    end = int(batch.end_positions[0, 0])
    if ids[end] != agent.eos_token_id:  # cut at 3 tokens: the template's closing comes first, untrained
        assert ids[end + 1] == agent.eos_token_id and batch.loss_mask[0, end + 1] == 0


def letter_count_data(**overrides) -> EpisodeDataModule:
    """One episode per task in the letter-count game, dense rewards."""
    kwargs = dict(
        train_path=str(CORRIDOR / "train.jsonl"), env="letter-count", num_generations=1, reward_density="dense"
    )
    return EpisodeDataModule(**{**kwargs, **overrides})


def test_data_top_k_reaches_the_episodes(agent):
    """``data.top_k`` through the episode settings to the engine: with top-k 1 every sampled episode
    plays the greedy one (the tiny model's distribution is near uniform: without it none would)."""
    data = letter_count_data(max_turns=2, sampling={"max_new_tokens": 5, "top_k": 1}, num_generations=2)
    assert data.episode.sampling.top_k == 1
    (sampled,) = data.rollout([agent], [{"task_id": "t"}], greedy=False)
    (greedy,) = data.rollout([agent], [{"task_id": "t"}], greedy=True)
    width = greedy.input_ids.shape[1]
    for row in sampled.input_ids:
        assert torch.equal(row[:width], greedy.input_ids[0])


def test_context_budget_truncates_and_keeps_the_reward(agent):
    torch.manual_seed(0)
    start = len(agent.encode_prompt(make_env("letter-count").start({"task_id": "t"})[0]))
    data = letter_count_data(max_turns=5, sampling={"max_new_tokens": 8}, max_context_tokens=start + 30)
    (batch,) = data.rollout([agent], [{"task_id": "t"}], greedy=False)
    assert batch.truncated.all() and int(batch.num_turns[0]) < 5
    assert int(batch.attention_mask.sum()) <= start + 30
    played = int(batch.num_turns[0])  # the turns it played keep their rewards
    assert torch.allclose(batch.rewards[0, :played].sum(), batch.scores[0, played - 1] * 0.5 / 9)
    with pytest.raises(ValueError, match="leaves no room for a reply"):
        settings = EpisodeSettings(sampling=Sampling(max_new_tokens=8), max_context_tokens=start)
        run_episodes([agent], [{"task_id": "t"}], make_env("letter-count"), settings)


def test_token_rewards_sit_on_each_turns_end_token(agent):
    torch.manual_seed(0)
    data = letter_count_data(max_turns=3, sampling={"max_new_tokens": 6})
    (batch,) = data.rollout([agent], [{"task_id": "a"}, {"task_id": "b"}], greedy=False)
    placed = batch.token_rewards(batch.rewards)
    for b in range(2):
        for t in range(int(batch.num_turns[b])):
            assert placed[b, batch.end_positions[b, t]] == batch.rewards[b, t]
            assert batch.loss_mask[b, batch.end_positions[b, t]] == 1
    assert torch.allclose(placed.sum(dim=1), batch.rewards.sum(dim=1))


# --------------------------------------------------------------------------- fits
def _fit(tmp_path, module, env, num_generations, precision="32-true", **data_kwargs):
    L.seed_everything(0)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = EpisodeDataModule(
        train_path=str(CORRIDOR / "train.jsonl"),
        env=env,
        tasks_per_step=2,
        num_generations=num_generations,
        max_turns=3,
        sampling={"max_new_tokens": 6, "temperature": 1.5},
        **data_kwargs,
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, precision=precision)
    trainer.fit(module, datamodule=data)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    return trainer.callback_metrics, moved


@pytest.mark.parametrize(
    "kwargs",
    [
        {"critic": {"kind": "head"}, "advantage": {"gae": "token"}},
        {"critic": {"kind": "model", "learning_rate": 1e-3}, "advantage": {"gae": "turn"}},
        {"critic": {"kind": "head"}, "advantage": {"gae": "token"}, "kl": {"coef": 0.1, "mode": "reward"}},
        # LoRA: the KL reference is the base with the adapters disabled (no copy of the weights)
        {
            "critic": {"kind": "head"},
            "advantage": {"gae": "turn"},
            "kl": {"coef": 0.1, "mode": "loss"},
            "lora": {"r": 4, "alpha": 8},
        },
    ],
)
def test_ppo_fit_moves_policy_and_critic(tmp_path, kwargs):
    module = PPO(model="tiny-random", learning_rate=1e-2, update={"ppo_epochs": 2}, **kwargs)
    metrics, moved = _fit(tmp_path, module, "corridor", 1, reward_density="dense")
    for key in (
        "train/loss",
        "train/approx_kl",
        "train/clip_frac",
        "agent0/explained_variance",
        "agent0/value_mean",
        "turn_0/reward",
        "turn_2/advantage",
        "train/won",
        "train/truncated",
    ):
        assert key in metrics and torch.isfinite(metrics[key]), key
    if kwargs.get("kl"):  # the KL to the reference per sampled token (k3, >= 0)
        assert float(metrics["agent0/kl_ref"]) >= 0.0
    assert any(n.startswith("agents.0.") for n in moved)
    assert any(n.startswith("value_heads.0.") for n in moved)
    if "lora" in kwargs:
        assert module.references is None and all("lora_" in n for n in moved if n.startswith("agents.0."))
    if kwargs["critic"]["kind"] == "model":
        assert any(n.startswith("critic_backbones.0.") for n in moved)


@pytest.mark.parametrize("gae", ["turn", "token"])
def test_ppo_values_are_fp32_under_bf16_autocast(tmp_path, gae):
    """Under bf16-mixed (a CPU with bf16 units picks it) the value head still computes in fp32: its
    values sit beside GAE's fp32 returns (turn-level GAE writes them into one tensor)."""
    module = PPO(model="tiny-random", learning_rate=1e-2, advantage={"gae": gae})
    metrics, moved = _fit(tmp_path, module, "corridor", 1, precision="bf16-mixed", reward_density="dense")
    assert torch.isfinite(metrics["agent0/explained_variance"])
    assert any(n.startswith("value_heads.0.") for n in moved)
    hidden = torch.randn(2, 3, module.value_heads[0].net[0].in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = module.value_heads[0](hidden)
    assert values.dtype == torch.float32 and torch.equal(values, module.value_heads[0](hidden))


@pytest.mark.parametrize(
    "cls, turn_level, step_weight",
    [(GRPO, False, 0.0), (RLOO, False, 0.0), (GRPO, True, 0.0), (RLOO, True, 0.0), (GRPO, False, 1.0)],
)
def test_group_fits_move_the_policy(tmp_path, cls, turn_level, step_weight):
    advantage = {"turn_level": turn_level, "step_weight": step_weight}
    module = cls(model="tiny-random", learning_rate=1e-2, advantage=advantage)
    metrics, moved = _fit(tmp_path, module, "letter-count", 4, reward_density="dense")
    for key in ("train/loss", "turn_0/reward", "turn_1/advantage", "train/reward"):
        assert key in metrics and torch.isfinite(metrics[key]), key
    assert any(n.startswith("agents.0.") for n in moved)
    if step_weight:  # every episode starts from the same state: at least turn 0 groups
        assert 0 < metrics["train/anchor_grouped_frac"] <= 1 and metrics["train/anchor_group_size"] >= 2


def test_group_algorithms_need_groups(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.num_generations=1"):
        _fit(tmp_path, GRPO(model="tiny-random"), "corridor", 1)


def test_episode_data_errors():
    with pytest.raises(ConfigError, match=r"data\.max_context_tokens=8"):
        EpisodeDataModule(
            train_path=str(CORRIDOR / "train.jsonl"),
            env="corridor",
            sampling={"max_new_tokens": 8},
            max_context_tokens=8,
        )
    with pytest.raises(ConfigError, match=r"data\.score_weight=1\.0"):
        EpisodeDataModule(train_path=str(CORRIDOR / "train.jsonl"), env="corridor", score_weight=1.0)
    with pytest.raises(ConfigError, match=r"data\.env='nope'"):
        EpisodeDataModule(train_path=str(CORRIDOR / "train.jsonl"), env="nope")


@pytest.mark.parametrize("config", ["configs/ppo/corridor_tiny.yaml", "configs/grpo/corridor_tiny.yaml"])
def test_episode_configs_run_from_the_cli(tmp_path, monkeypatch, config):
    from helpers import cli_fit

    monkeypatch.chdir(REPO_ROOT)
    cli = cli_fit(tmp_path, "--trainer.limit_train_batches=1", config=config)
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and "val/won" in metrics and "turn_0/reward" in metrics


# --------------------------------------------------------------------------- several agents
def test_each_agent_has_its_own_sequence(agent):
    torch.manual_seed(0)
    other = Agent("tiny-random")
    settings = EpisodeSettings(group_size=2, max_turns=3, sampling=Sampling(max_new_tokens=5))
    batches = run_episodes([agent, other], [{"task_id": "t"}], make_env("two-letters"), settings)
    assert len(batches) == 2
    texts = [agent.tokenizer.decode(b.input_ids[0][b.attention_mask[0].bool()]) for b in batches]
    assert "many e's" in texts[0] and "many a's" not in texts[0] and "e's." in texts[0]
    assert "many a's" in texts[1] and "many e's" not in texts[1]
    assert torch.equal(batches[0].won, batches[1].won) and torch.equal(batches[0].scores, batches[1].scores)
    for b in batches:  # each turn's end token is the agent's own sampled token
        assert all(b.loss_mask[r, b.end_positions[r, t]] == 1 for r in range(2) for t in range(int(b.num_turns[r])))


@pytest.mark.parametrize("share", [False, True])
def test_two_agent_fits(tmp_path, share):
    """Step-level groups per agent: each agent's steps group over its own observations."""
    module = GRPO(
        model="tiny-random", num_agents=2, share_parameters=share, learning_rate=1e-2, advantage={"step_weight": 1.0}
    )
    metrics, moved = _fit(tmp_path, module, "two-letters", 4, reward_density="dense")
    names = ["shared"] if share else ["agent0", "agent1"]
    for name in names:
        assert torch.isfinite(metrics[f"{name}/loss"]), name
    assert metrics["train/anchor_grouped_frac"] > 0
    assert any(n.startswith("agents.0.") for n in moved)
    if not share:
        assert any(n.startswith("agents.1.") for n in moved)
    ppo = PPO(model="tiny-random", num_agents=2, learning_rate=1e-2)
    metrics, moved = _fit(tmp_path, ppo, "two-letters", 1, reward_density="dense")
    assert any(n.startswith("value_heads.1.") for n in moved) and any(n.startswith("agents.1.") for n in moved)


def test_episode_held_out_evaluation(agent):
    data = EpisodeDataModule(
        train_path=str(CORRIDOR / "train.jsonl"),
        env="corridor",
        val_path=str(CORRIDOR / "heldout.jsonl"),
        max_turns=2,
        sampling={"max_new_tokens": 4},
        eval_tasks_per_step=4,
    )
    results = data.evaluate([agent])
    assert set(results) == {"reward", "won", "final_score", "turns"} and results["turns"] == 2.0


def test_episodes_record_anchor_states(agent):
    """Corridor's state key groups equal rooms and items whatever the replies; an episode the game
    ends early records no anchor after its end; the observation anchor tells apart what the state
    key joins (the message of the move that led there)."""
    from helpers import ScriptedEngine

    # a pit corridor: the start is room 2 of 4 (S), the key lies in room 3 (K); west of S is the pit
    script = [
        ["east", "hello", "west", "east"],  # turn 0, episodes 0-3 (2 falls into the pit: lost, over)
        ["west", "east", "east"],  # turn 1, episodes 0, 1, 3
        ["east", "take key", "take key"],  # turn 2
    ]
    task = {"length": 4, "key_room": 2, "pit": True, "max_steps": 12}
    settings = EpisodeSettings(group_size=4, max_turns=3, sampling=Sampling(max_new_tokens=4), anchor="state")
    play = lambda s: run_episodes([agent], [task], make_env("corridor"), s, engine=ScriptedEngine(script))[0]  # noqa: E731
    batch = play(settings)
    a = batch.anchors
    assert batch.num_turns.tolist() == [3, 3, 1, 3] and bool(batch.lost[2])
    assert ((a >= 0) == batch.alive).all()
    S, K, R = int(a[0, 0]), int(a[0, 1]), int(a[3, 2])
    assert a.tolist() == [[S, K, S], [S, S, K], [S, -1, -1], [S, K, R]] and len({S, K, R}) == 3
    shared = anchor_groups(a, batch.alive, 4)
    assert shared[:, 0].tolist() == [4, 4, 5, 5]  # the 6 turns in S, less the row's own
    assert shared[3, 2] == 0  # room 4: a singleton
    by_observation = play(replace(settings, anchor="observation")).anchors
    assert (by_observation[:, 0] == by_observation[0, 0]).all()  # one start
    assert by_observation[1, 1] != by_observation[1, 0]  # still in S, but "I don't understand" was said


@pytest.mark.parametrize("critic", ["head", "model"])
def test_critic_warmup_trains_the_critic_only(tmp_path, critic):
    """veRL's critic_warmup: during the first n RL steps the policy keeps its weights bit for bit
    (a value head learns on its features without moving them); the critic learns. The policy's
    AdamW does not step at all: weight decay would move its weights, and a step count advanced on
    zero gradients would shrink its first real updates (bias correction)."""
    module = PPO(
        model="tiny-random",
        learning_rate=1e-2,
        weight_decay=0.1,
        critic={"kind": critic, "warmup": 1},
        advantage={"gae": "turn"},
    )
    metrics, moved = _fit(tmp_path, module, "corridor", 1, reward_density="dense")
    assert not any(n.startswith("agents.") for n in moved), sorted(n for n in moved if n.startswith("agents."))[:3]
    assert any(n.startswith("value_heads.0.") for n in moved)
    assert float(metrics["train/critic_warmup"]) == 1.0 and module.rl_steps == 1
    optimizer = module.trainer.optimizers[0]
    for group in optimizer.param_groups:
        stepped = [p for p in group["params"] if "step" in optimizer.state.get(p, {})]
        if group["role"] == "policy":
            assert not stepped, f"{len(stepped)} policy tensors have AdamW state"
        else:
            assert stepped and all(float(optimizer.state[p]["step"]) == module.update.ppo_epochs for p in stepped)


class CountingGame(Game):
    """A new game with its own named task set, all in one class: ``counting:<n>`` is n tasks whose
    target is the number of words to write (generated into a task file on first use, then cached)."""

    task_sets = ("counting",)
    cloneable = True

    @staticmethod
    def resolve_set(source: str, field: str) -> str:
        count = int(source.split(":")[1])
        out = cache_dir() / f"counting-{count}.jsonl"
        out.write_text("".join(json.dumps({"task_id": f"c{i}", "target": 2 + i % 3}) + "\n" for i in range(count)))
        return str(out)

    def start(self, task):
        self.target, self.score = task["target"], 0
        return [f"Write exactly {self.target} words."]

    def act(self, actions):
        self.score = float(len(actions[0].split()) == self.target)
        info = {"won": bool(self.score), "lost": False, "score": self.score, "max_score": 1.0}
        return StepResult(["Again."], terminated=bool(self.score), info=info)


def test_a_new_game_with_its_own_task_sets_is_one_class(tmp_path, monkeypatch):
    """The game above plays as episodes and in a joint tree, its named set loaded by the game itself:
    nothing else (no registry, no second table of sets) knows about it."""
    monkeypatch.setenv("LIT_MARL_CACHE", str(tmp_path))
    episodes = EpisodeDataModule(train_path="counting:5", env=CountingGame(), num_generations=2, max_turns=2)
    assert [row["task_id"] for row in episodes.train_tasks] == [f"c{i}" for i in range(5)]
    agent = Agent("tiny-random")
    (batch,) = episodes.rollout([agent], episodes.train_tasks[:2], greedy=False)
    assert batch.rewards.shape[0] == 4 and torch.isfinite(batch.rewards).all()
    trees = RolloutDataModule(train_path="counting:3", env=CountingGame(), num_generations=2, num_turns=2)
    tree = trees.rollout([agent], trees.train_tasks[:2], greedy=False)
    assert tree.stats["turn_0/nodes"] == 2.0 and torch.isfinite(tree.rewards).all()


@pytest.mark.parametrize("skip", [False, True])
def test_grpo_skips_steps_without_signal_when_asked(tmp_path, skip):
    """skip_signalless_steps: a step whose groups all tied (sparse Corridor: the tiny model wins
    nothing) is not taken: AdamW keeps no state and counts no step; taken, AdamW steps on zero
    gradients (its momentum would carry an earlier step's direction on)."""
    module = GRPO(model="tiny-random", learning_rate=1e-2, update={"skip_signalless_steps": skip})
    metrics, moved = _fit(tmp_path, module, "corridor", 2, reward_density="sparse")
    assert float(metrics["train/won"]) == 0.0 and not moved  # every group tied
    optimizers = module.optimizers()
    state = (optimizers[0] if isinstance(optimizers, list) else optimizers).optimizer.state
    steps = {int(s["step"]) for s in state.values()}
    assert steps == (set() if skip else {1})
    assert ("train/skipped_steps" in metrics) == skip and (not skip or float(metrics["train/skipped_steps"]) == 1.0)


def test_skip_signalless_steps_is_refused_where_every_step_has_a_gradient(tmp_path):
    with pytest.raises(ConfigError, match="model.update.skip_signalless_steps: PPO's steps all carry a gradient"):
        _fit(tmp_path, PPO(model="tiny-random", update={"skip_signalless_steps": True}), "corridor", 1)
    with pytest.raises(ConfigError, match="model.update.skip_signalless_steps: GRPO's steps"):
        _fit(
            tmp_path, GRPO(model="tiny-random", kl={"coef": 0.1}, update={"skip_signalless_steps": True}), "corridor", 2
        )


def test_a_step_is_signalless_when_its_advantages_tie_up_to_rounding():
    from types import SimpleNamespace

    module = GRPO(model="tiny-random")
    tied = SimpleNamespace(advantages=torch.tensor([[-1.39e-17, 0.0], [1.39e-17, 4e-18]]))  # RLOO on tied 0.1s
    assert module.signalless(tied) and module.signalless(None)
    assert not module.signalless(SimpleNamespace(advantages=torch.tensor([[0.0, 0.25]])))
