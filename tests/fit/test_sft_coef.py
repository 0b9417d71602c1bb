"""RL that keeps learning the demonstrations (``model.update.sft_coef``, PPO-ptx): every optimizer step
of the episode algorithms adds sft_coef x the demonstrations' mean negative log-likelihood of the next
batch of ``data.demos``."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import REPO_ROOT, make_trainer
from lit_marl import ConfigError
from lit_marl.algorithms import GRPO, PPO, SFT
from lit_marl.data import EpisodeDataModule
from lit_marl.tasks import TaskLoader

CORRIDOR = REPO_ROOT / "data" / "corridor"


def test_demonstration_draws_walk_epoch_after_epoch_and_split_over_ranks_as_one_process():
    rows = [{"i": i} for i in range(10)]
    one = TaskLoader(rows, batch_size=4, seed=3, name="demos")
    iterated = [batch for _ in range(2) for batch in one]  # two epochs as the SFT phase iterates them
    assert [TaskLoader(rows, 4, 3, name="demos").drawn(k) for k in range(6)] == iterated
    assert [r["i"] for r in iterated[3]] != [r["i"] for r in iterated[0]]  # epoch 1 is another order
    ranks = [TaskLoader(rows, 2, 3, rank, 2, "demos") for rank in (0, 1)]
    for k in (0, 1, 3, 4):  # whole batches (a padded last one aside): two ranks take one process's rows
        assert ranks[0].drawn(k) + ranks[1].drawn(k) == one.drawn(k)


def _fit(tmp_path, module, steps: int = 1, trainer=None, **data_kwargs):
    L.seed_everything(0)
    data = EpisodeDataModule(
        train_path=str(CORRIDOR / "train.jsonl"),
        env="corridor",
        tasks_per_step=2,
        max_turns=3,
        demos={"path": str(CORRIDOR / "demos.jsonl"), "batch_size": 4},
        sampling={"max_new_tokens": 6, "temperature": 1.5},
        **data_kwargs,
    )
    trainer = trainer or make_trainer(tmp_path, limit_train_batches=steps, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    return trainer.callback_metrics


def test_a_step_without_rl_signal_is_the_sft_step_on_the_next_demonstrations(tmp_path):
    """GRPO on sparse Corridor, where the tiny model wins nothing (every group ties, no policy
    gradient): with sft_coef 1 its one optimizer step is SFT's first step, on the same demonstrations
    (the walk's first batch is the SFT phase's first), to the last bit of AdamW's update."""
    grpo = GRPO(model="tiny-random", learning_rate=1e-2, update={"sft_coef": 1.0})
    rl = _fit(tmp_path / "rl", grpo, num_generations=2, reward_density="sparse")
    assert float(rl["train/won"]) == 0.0 and grpo.demo_draws == 1
    sft = SFT(model="tiny-random", num_agents=1, learning_rate=1e-2)
    sft_metrics = _fit(tmp_path / "sft", sft, reward_density="sparse")
    assert float(rl["train/sft_loss"]) == pytest.approx(float(sft_metrics["train/sft_loss"]), rel=1e-5)
    for (name, a), (_, b) in zip(grpo.agents[0].model.named_parameters(), sft.agents[0].model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_ppo_learns_the_demonstrations_beside_its_rollouts_once_its_critic_has_warmed_up(tmp_path):
    """While PPO's critic warms up (the first update) the policy rests: no batch is drawn (it would be
    computed and dropped); then each of the 2 epochs' optimizer steps learns the next batch. The loss is
    the SFT phase's key; the count of batches learned is in the checkpoint state."""
    module = PPO(
        model="tiny-random", learning_rate=1e-3, critic={"warmup": 1}, update={"ppo_epochs": 2, "sft_coef": 0.5}
    )
    metrics = _fit(tmp_path, module, steps=2, reward_density="dense")
    for key in ("train/sft_loss", "agent0/sft_loss", "train/loss"):
        assert torch.isfinite(metrics[key]), key
    assert module.demo_draws == 2 and module.rank_state()["demo_draws"] == 2
    resumed = PPO(model="tiny-random")
    resumed.load_rank_state(module.rank_state())
    assert resumed.demo_draws == 2


def test_sft_coef_is_refused_without_demonstrations_or_beside_skipped_steps(tmp_path):
    data = EpisodeDataModule(train_path=str(CORRIDOR / "train.jsonl"), env="corridor", tasks_per_step=2)
    with pytest.raises(ConfigError, match=r"model.update.sft_coef=0.5: .* set data.demos.path"):
        make_trainer(tmp_path).fit(PPO(model="tiny-random", update={"sft_coef": 0.5}), datamodule=data)
    from lit_marl.callbacks import PhaseSwitch

    more = make_trainer(tmp_path, callbacks=[PhaseSwitch(budget=8, split="4:4")])  # the file holds 45
    with pytest.raises(ConfigError, match="model.update.sft_coef: RL keeps learning .* 45 .* give a file of exactly 4"):
        _fit(tmp_path, PPO(model="tiny-random", update={"sft_coef": 0.5}), trainer=more)
    skipping = GRPO(model="tiny-random", update={"sft_coef": 0.5, "skip_signalless_steps": True})
    with pytest.raises(ConfigError, match="model.update.skip_signalless_steps: GRPO's steps all carry a gradient"):
        _fit(tmp_path, skipping, num_generations=2)
