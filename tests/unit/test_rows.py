"""The one stacking and slicing of the row containers (``rollout.batch.Rows``): prompts stay
left-padded and responses right-padded whatever parts are stacked, position fields move with the
padding, group ids stay distinct per part, and ``select`` drops the columns padding in every row."""

from __future__ import annotations

import torch

from lit_marl.algorithms.critics import CriticInputs
from lit_marl.rollout.batch import AgentSamples, TrajectorySamples

T = torch.tensor


def agent_rows(ids, mask, prompt, **extra):
    ids, mask = T(ids), T(mask)
    return AgentSamples(
        input_ids=ids,
        attention_mask=mask,
        completion_mask=mask[:, prompt:],
        returns=None,
        group_ids=torch.arange(len(ids)),
        turn_ids=torch.zeros(len(ids), dtype=torch.long),
        **extra,
    )


def test_agent_samples_of_two_widths_stack_prompt_left_and_response_right():
    # prompt 2 + response 1, and prompt 1 + response 3 (its last position padding)
    a = agent_rows([[5, 6, 7]], [[1, 1, 1]], 2, rollout_logprobs=T([[-0.5]]))
    b = agent_rows([[8, 9, 4, 0]], [[1, 1, 1, 0]], 1, rollout_logprobs=T([[-1.0, -2.0, 0.0]]))
    both = AgentSamples.cat([a, b], pad_id=0)
    assert both.input_ids.tolist() == [[5, 6, 7, 0, 0], [0, 8, 9, 4, 0]]
    assert both.attention_mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0]]
    assert both.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert both.rollout_logprobs.tolist() == [[-0.5, 0, 0], [-1.0, -2.0, 0.0]]
    assert both.returns is None and both.group_ids.tolist() == [0, 0]  # tree node ids are kept as given
    # the second row alone: no left padding in its prompt, a response of 2 tokens
    alone = both.select(T([1]))
    assert alone.input_ids.tolist() == [[8, 9, 4]] and alone.completion_mask.tolist() == [[1, 1]]
    assert alone.rollout_logprobs.tolist() == [[-1.0, -2.0]]


def test_episode_groups_stay_distinct_per_part_and_select_trims_the_left():
    def episodes(widths, groups):
        W = max(widths)
        mask = T([[0] * (W - w) + [1] * w for w in widths])
        zeros = torch.zeros(mask.shape)
        return TrajectorySamples(
            mask * 3, mask, mask, zeros, zeros, zeros, zeros, mask, None, None, T(groups), T([0] * len(widths))
        )

    both = TrajectorySamples.cat([episodes([2, 1], [0, 0]), episodes([3], [4])], pad_id=9)
    assert both.input_ids.tolist() == [[9, 3, 3], [9, 0, 3], [3, 3, 3]]  # the part's own padding was 0
    assert both.group_ids.tolist() == [0, 0, 1]
    assert both.ref_logprobs is None
    assert both.select(T([0, 1])).input_ids.tolist() == [[3, 3], [0, 3]]


def test_critic_positions_move_with_the_padding():
    one = CriticInputs(T([[1, 2]]), T([[1, 1]]), T([1]))
    two = CriticInputs(T([[0, 0, 3, 4]]), T([[0, 0, 1, 1]]), T([3]))
    both = CriticInputs.cat([one, two], pad_id=0)
    assert both.input_ids[0, both.positions[0]] == 2 and both.input_ids[1, both.positions[1]] == 4
    picked = both.select(T([1]))
    assert picked.input_ids.tolist() == [[3, 4]] and picked.positions.tolist() == [1]
