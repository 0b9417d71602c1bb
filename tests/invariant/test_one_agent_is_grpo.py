"""MAGRPO with one agent and one turn is GRPO."""

from __future__ import annotations

import lightning as L
import torch

from helpers import SGDRecordingMAGRPO, make_trainer, sgd_recording, slogan_data
from lit_marl.generation.base import TrainerWeights


def test_single_agent_step_equals_plain_grpo(tmp_path):
    """num_agents=1, T=1, default settings: the update is GRPO's, computed here from scratch:
    A = (r - mean_group) / std_group, loss = -mean_rows(A * sum of the response's token log-probs)."""
    import torch.nn.functional as F

    from lit_marl.agents import Agent

    L.seed_everything(5)
    module = SGDRecordingMAGRPO(model="tiny-random", num_agents=1, max_grad_norm=0.0)
    data = slogan_data(
        agent_prompts=["Write a slogan for {topic} with {word0}."], sampling={"max_new_tokens": 16}, tasks_per_step=2
    )
    make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0, logger=False).fit(module, datamodule=data)
    (batch,) = module.seen
    samples = batch.agents[0]
    rewards = batch.rewards.view(2, 4)  # 2 tasks x G=4, rows in the same order
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True).clamp(min=1e-3)).reshape(-1)
    assert advantages.abs().sum() > 0, "no learning signal: the check is void"

    reference = Agent("tiny-random").model
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(module.before[0][name])
    # an independent forward: each row alone, unpadded
    C = samples.num_completion
    total = 0.0
    for row in range(len(samples)):
        ids = samples.input_ids[row][samples.attention_mask[row].bool()]
        n = int(samples.completion_mask[row].sum())
        logits = reference(input_ids=ids[None]).logits[0]
        completion = ids[-n:] if n else ids[:0]
        logp = -F.cross_entropy(logits[-n - 1 : -1], completion, reduction="sum")
        total = total - advantages[row] * logp
    (total / len(samples)).backward()
    assert C >= 1
    for name, p in module.agents[0].model.named_parameters():
        step = module.before[0][name] - p.detach()
        grad = dict(reference.named_parameters())[name].grad
        expected = grad if grad is not None else torch.zeros_like(step)
        torch.testing.assert_close(step, expected, atol=1e-5, rtol=1e-3, msg=name)


class FixedLengthEngine(TrainerWeights):
    """Replies of three tokens plus the end token, different per sample and prompt (so rewards differ
    within a group), the same in a tree and in episodes: sample k of prompt p at turn t."""

    name = "fixed-length"

    def generate_team(self, calls, *args, **kwargs):
        from lit_marl.generation.base import Generation, left_pad

        outs = []
        for agent, prompts, num_samples in calls:
            rows = [list(p) for p in prompts for _ in range(num_samples)]
            prompt_ids, prompt_mask = left_pad(rows, agent.pad_token_id, torch.device("cpu"))
            replies = [
                [20 + (r * 101 + j * 53) % 500 for j in range(3)] + [agent.eos_token_id] for r in range(len(rows))
            ]
            ids = torch.tensor(replies)
            outs.append(Generation(prompt_ids, prompt_mask, ids, torch.ones_like(ids), num_samples))
        return outs


def test_magrpo_with_one_agent_and_one_turn_is_grpo_on_one_turn_episodes(tmp_path):
    """The same text environment as a tree (MAGRPO) and as one-turn episodes (GRPO), the same replies:
    the same rewards, and the same update (plain SGD, lr 1). MAGRPO's loss is a mean over responses
    (``logprob_reduction: mean``), GRPO's a mean over action tokens: with replies of one length they
    are one number."""
    from helpers import LENGTH_REWARD
    from lit_marl.algorithms import GRPO
    from lit_marl.data import EpisodeDataModule
    from lit_marl.envs.base import FunctionEnv
    from lit_marl.tasks import import_object

    SGDRecordingGRPO = sgd_recording(GRPO)
    prompt = ["Write a slogan for {topic} with {word0}."]
    steps, rewards = [], []
    for family in ("tree", "episodes"):
        L.seed_everything(5)
        if family == "tree":
            module = SGDRecordingMAGRPO(
                model="tiny-random", num_agents=1, max_grad_norm=0.0, update={"logprob_reduction": "mean"}
            )
            data = slogan_data(agent_prompts=prompt, reward_fn=LENGTH_REWARD, tasks_per_step=2, val_path=None)
        else:
            module = SGDRecordingGRPO(model="tiny-random", num_agents=1, max_grad_norm=0.0)
            env = FunctionEnv(prompt, import_object(LENGTH_REWARD, "reward"))
            data = EpisodeDataModule(
                train_path=slogan_data().hparams.train_path, env=env, tasks_per_step=2, num_generations=4, max_turns=1
            )
        data.engine = FixedLengthEngine()
        make_trainer(tmp_path / family, limit_train_batches=1, limit_val_batches=0, logger=False).fit(
            module, datamodule=data
        )
        (batch,) = module.seen
        rewards.append(batch.rewards.view(-1) if family == "tree" else batch[0].rewards.sum(dim=1))
        model = module.agents[0].model
        steps.append({n: module.before[0][n] - p.detach() for n, p in model.named_parameters()})
    torch.testing.assert_close(rewards[0], rewards[1])
    assert rewards[0].view(2, 4).std(dim=1).min() > 0, "no learning signal: the check is void"
    moved = 0
    for name, step in steps[0].items():
        torch.testing.assert_close(step, steps[1][name], atol=1e-6, rtol=1e-4, msg=name)
        moved += int(step.abs().sum() > 0)
    assert moved > 0
