"""pass@k against hand computations and brute-force enumeration; the weighted evaluation means."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lit_marl.metrics import EvalMeans, PassAtK, markdown_line, pass_at_k, peak_flops


def _brute_force(n: int, c: int, k: int) -> float:
    """The share of the C(n, k) draws of k samples without replacement holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in draw) for draw in draws) / len(draws)


def test_pass_at_k_by_hand():
    # n=5, c=1, k=2: 1 - C(4,2)/C(5,2) = 1 - 6/10; n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    values = pass_at_k(torch.tensor([5, 10, 4, 4, 7]), torch.tensor([1, 3, 0, 4, 3]), 2)
    assert values[0] == pytest.approx(0.4)
    assert pass_at_k(torch.tensor([10]), torch.tensor([3]), 5)[0] == pytest.approx(1 - 21 / 252)
    assert values[2] == 0.0 and values[3] == 1.0  # none correct; all correct
    assert values[4] == pytest.approx(1 - math.comb(4, 2) / math.comb(7, 2))
    # pass@1 is the fraction correct, per problem
    assert pass_at_k(torch.tensor([8, 8]), torch.tensor([3, 0]), 1).tolist() == pytest.approx([3 / 8, 0.0])


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert float(pass_at_k(torch.tensor([n]), torch.tensor([c]), k)[0]) == pytest.approx(_brute_force(n, c, k))


def test_pass_at_k_refuses_too_few_samples_and_bad_counts():
    with pytest.raises(ValueError, match="pass@3 needs at least 3 samples per problem; got 2"):
        pass_at_k(torch.tensor([2]), torch.tensor([1]), 3)
    with pytest.raises(ValueError, match="between 0 and its samples"):
        pass_at_k(torch.tensor([4]), torch.tensor([5]), 1)


def test_pass_at_k_metric_is_the_mean_over_problems_of_every_update():
    metric = PassAtK(2)
    metric.update(torch.tensor([5]), torch.tensor([1]))
    metric.update(torch.tensor([4, 4]), torch.tensor([0, 4]))
    assert float(metric.compute()) == pytest.approx((0.4 + 0.0 + 1.0) / 3)


def test_eval_means_weigh_each_update_by_its_tasks():
    means = EvalMeans()
    means.update("won", 1.0, 3)  # a batch of 3 tasks, all won
    means.update("won", 0.0, 1)
    means.update("won/pick", 0.5, 2)  # a subset's mean over its own 2 tasks
    assert means.compute() == pytest.approx({"won": 0.75, "won/pick": 0.5})


def test_markdown_line_and_peak_flops():
    # TensorBoard's Markdown shows a backslash before < and >: those become entities
    assert markdown_line("a *b*\n<c> | d & e", 100) == "a \\*b\\* &lt;c&gt; \\| d &amp; e"
    assert markdown_line("x" * 10, 4) == "xxxx …"
    assert peak_flops(torch.device("cpu")) is None


def test_pass_tokens_count_a_shared_prompt_once():
    from lit_marl.rollout.batch import AgentSamples, pass_tokens

    # two nodes of 2 rows: prompts of 3 and 2 real tokens (left-padded to 3), completions 2 and 1
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    rows = AgentSamples(
        input_ids=torch.zeros(4, 5, dtype=torch.long),
        attention_mask=attention,
        completion_mask=attention[:, 3:],
        returns=torch.zeros(4),
        group_ids=torch.tensor([0, 0, 1, 1]),
        turn_ids=torch.zeros(4, dtype=torch.long),
    )
    assert pass_tokens(rows, shared_prompts=False) == int(attention.sum()) == 16
    assert pass_tokens(rows, shared_prompts=True) == 3 + 2 + (2 + 1 + 1 + 2)
