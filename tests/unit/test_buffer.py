"""Rollout buffers, mini-batches and the flush of what is left at the end of an epoch."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers import make_trainer, slogan_data
from lit_marl.algorithms import MAGRPO
from lit_marl.rollout.batch import AgentSamples
from lit_marl.rollout.buffer import RolloutBuffer, minibatches


def _samples(num_nodes: int, G: int, turns: list[int], prompt_len: int = 3, completion_len: int = 2) -> AgentSamples:
    rows = num_nodes * G
    return AgentSamples(
        input_ids=torch.arange(rows * (prompt_len + completion_len)).view(rows, -1),
        attention_mask=torch.ones(rows, prompt_len + completion_len, dtype=torch.long),
        completion_mask=torch.ones(rows, completion_len, dtype=torch.long),
        returns=torch.arange(rows, dtype=torch.float32),
        group_ids=torch.arange(num_nodes).repeat_interleave(G),
        turn_ids=torch.tensor(turns).repeat_interleave(G),
        advantages=torch.ones(rows),
    )


def test_minibatches_cover_every_row_once_and_keep_turns_and_nodes_together():
    samples = _samples(7, 3, turns=[0, 0, 0, 1, 1, 1, 1])
    batches = minibatches(samples, 2, torch.Generator().manual_seed(0))
    rows = torch.cat(batches).sort().values
    assert torch.equal(rows, torch.arange(21))
    # turn 0: 3 nodes -> 2 + 1; turn 1: 4 nodes -> 2 + 2
    assert sorted(len(b) // 3 for b in batches) == [1, 2, 2, 2]
    for b in batches:
        assert len(torch.unique(samples.turn_ids[b])) == 1
        for node in torch.unique(samples.group_ids[b]):
            assert (samples.group_ids[b] == node).sum() == 3  # a node's G rows stay together
    assert minibatches(samples, None, torch.Generator())[0].tolist() == list(range(21))


def test_per_turn_schedule_gives_each_turn_its_own_steps_in_order():
    """CoMLRL's schedule: turn 0's mini-batches first, then turn 1's; ``None`` = one step per turn."""
    samples = _samples(7, 3, turns=[0, 0, 0, 1, 1, 1, 1])
    whole = minibatches(samples, None, torch.Generator().manual_seed(0), "per_turn")
    assert [b.tolist() for b in whole] == [list(range(9)), list(range(9, 21))]
    cut = minibatches(samples, 2, torch.Generator().manual_seed(0), "per_turn")
    assert [len(b) // 3 for b in cut] == [2, 1, 2, 2]  # ceil(3/2) + ceil(4/2) steps, turn by turn
    assert [int(samples.turn_ids[b[0]]) for b in cut] == [0, 0, 1, 1]
    assert torch.equal(torch.cat(cut).sort().values, torch.arange(21))


def test_minibatch_order_is_shuffled_and_seeded():
    samples = _samples(8, 2, turns=[0] * 8)
    first = [b.tolist() for b in minibatches(samples, 1, torch.Generator().manual_seed(1))]
    again = [b.tolist() for b in minibatches(samples, 1, torch.Generator().manual_seed(1))]
    other = [b.tolist() for b in minibatches(samples, 1, torch.Generator().manual_seed(2))]
    assert first == again and first != other


def test_buffer_keeps_node_ids_unique_and_drains():
    buffer = RolloutBuffer()
    buffer.add(_samples(2, 2, turns=[0, 0]))
    buffer.add(_samples(3, 2, turns=[0, 1, 1], prompt_len=5, completion_len=4))
    assert len(buffer) == 5
    drained = buffer.drain(pad_id=0)
    assert drained.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert drained.input_ids.shape == (10, 5 + 4)  # re-padded to the widest prompt and completion
    assert drained.advantages.shape == (10,)
    assert len(buffer) == 0 and buffer.drain(0) is None


def test_buffer_renumbers_next_node_links_with_the_nodes():
    """TD targets follow next_group from a turn's node to the node its joint action opened: the
    link must survive the renumbering that makes node ids unique in the buffer."""
    from dataclasses import replace

    buffer = RolloutBuffer()
    first = replace(_samples(3, 1, turns=[0, 1, 0]), next_group=torch.tensor([1, -1, -1]))
    # a second rollout whose tree numbered its nodes 5, 7, 9 (9 is the child of 5)
    second = replace(
        _samples(3, 1, turns=[0, 0, 1]), group_ids=torch.tensor([5, 7, 9]), next_group=torch.tensor([9, -1, -1])
    )
    buffer.add(first)
    buffer.add(second.with_advantages(None))  # actor-critic samples wait without advantages
    drained = buffer.drain(pad_id=0)
    assert drained.group_ids.tolist() == [0, 1, 2, 3, 4, 5]
    assert drained.next_group.tolist() == [1, -1, -1, 5, -1, -1]
    assert drained.advantages is None
    broken = replace(_samples(2, 1, turns=[0, 1]), next_group=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="not in these samples"):
        buffer.add(broken)


def test_buffer_fills_across_steps_and_flushes_at_epoch_end(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, buffer={"size": 3})
    # 2 nodes per step: step 1 waits (2), step 2 updates (4), step 3 waits (2) until the epoch ends
    steps = []
    update_agent = module.update_agent
    module.update_agent = lambda i, samples, loss_fn, count=None, **kw: (
        steps.append((i, count)) or update_agent(i, samples, loss_fn, count, **kw)
    )
    trainer = make_trainer(tmp_path, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(module, datamodule=slogan_data(sampling={"max_new_tokens": 16}, tasks_per_step=2))
    assert [i for i, _ in steps] == [0, 1, 0, 1]  # two updates x two agents, one optimizer step each
    assert all(len(b) == 0 for b in module.rollout_buffers)
    # Lightning counts the optimizer steps taken inside training_step only, not the epoch-end flush
    assert trainer.global_step == 2


def test_one_optimizer_step_per_minibatch(tmp_path):
    L.seed_everything(0)
    module = MAGRPO(model="tiny-random", num_agents=2, learning_rate=1e-2, update={"train_batch_size": 1})
    data = slogan_data(
        sampling={"max_new_tokens": 8},
        tasks_per_step=2,
        num_generations=2,
        num_turns=2,
        transition="lit_marl.rollout.transitions:plain",
    )
    trainer = make_trainer(tmp_path, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    nodes = 2 + 2 * 2  # aligned G=2: 2 roots + 4 children
    assert float(trainer.callback_metrics["agent0/optimizer_steps"]) == nodes
    assert trainer.global_step == 2 * nodes


@pytest.mark.parametrize(
    "rows, width, budget, cap, sizes",
    [
        (20, 10, None, None, [20]),  # no caps: one pass
        (20, 10, 100, None, [10, 10]),  # 10 rows of width 10 fill the budget
        (25, 10, 100, None, [10, 10, 5]),
        (20, 10, 100, 4, [4, 4, 4, 4, 4]),  # the row cap binds first
        (3, 50, 10, None, [1, 1, 1]),  # a row wider than the budget still gets its pass
        (20, 10, 10_000, 16, [16, 4]),  # the row cap alone
    ],
)
def test_micro_batches_respect_the_token_budget_and_row_cap(rows, width, budget, cap, sizes):
    module = MAGRPO(memory={"forward_batch_size": cap, "forward_token_budget": budget})
    samples = _samples(rows, 1, turns=[0] * rows, prompt_len=width - 2, completion_len=2)
    passes = module.micro_batches(samples)
    assert [len(p) for p in passes] == sizes
    assert torch.equal(torch.cat(passes), torch.arange(rows))  # every row once, in order


@pytest.mark.parametrize(
    "budget, sizes, unshared_sizes",
    [(32, [8, 8, 4], [3] * 6 + [2]), (28, [6, 6, 6, 2], [2] * 10), (None, [20], [20])],
)
def test_micro_batches_count_a_shared_prompt_once_per_node(budget, sizes, unshared_sizes):
    """5 nodes x G=4 rows, prompt 8 + completion 2 tokens: with shared prompts a whole node costs
    8 + 4 x 2 = 16 tokens (not 4 x 10), and a pass cut inside a node runs that prompt again."""
    module = MAGRPO(memory={"forward_token_budget": budget})
    samples = _samples(5, 4, turns=[0] * 5, prompt_len=8, completion_len=2)
    passes = module.micro_batches(samples, shared_prompts=True)
    assert [len(p) for p in passes] == sizes
    assert torch.equal(torch.cat(passes), torch.arange(20))
    for rows in passes:
        computed = 8 * len(torch.unique(samples.group_ids[rows])) + 2 * len(rows)
        assert budget is None or computed <= budget
    # without sharing every row costs its full width of 10
    assert [len(p) for p in module.micro_batches(samples)] == unshared_sizes
