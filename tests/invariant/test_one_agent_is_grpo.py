"""MAGRPO with one agent and one turn is GRPO."""

from __future__ import annotations

import lightning as L
import torch

from helpers import SGDRecordingMAGRPO, make_trainer, slogan_data


def test_single_agent_step_equals_plain_grpo(tmp_path):
    """num_agents=1, T=1, default settings: the update is GRPO's, computed here from scratch:
    A = (r - mean_group) / std_group, loss = -mean_rows(A * sum of the response's token log-probs)."""
    import torch.nn.functional as F

    from lit_marl.agents import Agent

    L.seed_everything(5)
    module = SGDRecordingMAGRPO(model="tiny-random", num_agents=1, max_grad_norm=0.0)
    data = slogan_data(agent_prompts=["Write a slogan for {topic} with {word0}."], max_new_tokens=16, tasks_per_step=2)
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
