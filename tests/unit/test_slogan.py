"""The two-line slogan reward on hand-written lines."""

from __future__ import annotations

import pytest

from lit_marl.envs.slogan import line_checks, reward

TASK = {"topic": "a coffee cart", "word0": "coffee", "word1": "friend"}
LINE0 = "Fresh coffee every morning makes the day bright!"  # 8 distinct words
LINE1 = "Share a warm cup with a good friend today!"  # 9 words, 8 distinct, no overlap with LINE0
LEVELS = {"reward", "success", "distinct", "single_line", "length_ok", "has_word", "ends_with_bang"}
NUM_CHECKS = 2 * 4 + 1  # four per line and one joint check


def score(line0: str, line1: str, task: dict = TASK) -> dict[str, float]:
    out = reward([[line0], [line1]], [task])
    assert set(out) == LEVELS
    assert all(len(v) == 1 for v in out.values())
    return {k: v[0] for k, v in out.items()}


def test_perfect_pair():
    out = score(LINE0, LINE1)
    assert out == {k: 1.0 for k in LEVELS}


def test_one_word_line_fails_length():
    out = score("Coffee!", LINE1)
    assert out["length_ok"] == 0.5
    assert out["has_word"] == out["ends_with_bang"] == out["single_line"] == 1.0
    assert out["reward"] == pytest.approx((NUM_CHECKS - 1) / NUM_CHECKS)
    assert out["success"] == 0.0


def test_repeated_word_fails_length():
    line = "coffee coffee coffee coffee coffee coffee coffee!"  # 7 words but 1 distinct
    assert not line_checks(line, "coffee")["length_ok"]
    out = score(line, LINE1)
    assert out["length_ok"] == 0.5
    assert out["success"] == 0.0
    assert out["reward"] == pytest.approx((NUM_CHECKS - 1) / NUM_CHECKS)


@pytest.mark.parametrize(
    "line, ok",
    [
        ("one two three four five coffee!", True),  # 6 words, the minimum
        ("one two three four coffee!", False),  # 5 words
        ("one two three four five six seven eight nine ten eleven coffee!", True),  # 12
        ("one two three four five six seven eight nine ten eleven twelve coffee!", False),  # 13
        ("coffee coffee two two three three!", False),  # 6 words, 3 distinct
        ("coffee one two three four four!", True),  # 6 words, 5 distinct
    ],
)
def test_length_bounds(line, ok):
    assert line_checks(line, "coffee")["length_ok"] is ok


def test_copied_lines_fail_distinct():
    line = "Fresh coffee with a friend makes every morning bright!"
    out = score(line, line)
    assert out["distinct"] == 0.0
    # every per-line check passes: only the joint check fails
    assert out["single_line"] == out["length_ok"] == out["has_word"] == out["ends_with_bang"] == 1.0
    assert out["reward"] == pytest.approx((NUM_CHECKS - 1) / NUM_CHECKS)
    assert out["success"] == 0.0


def test_near_copy_fails_distinct():
    out = score(LINE0, "Fresh coffee every morning makes the friend bright!")
    assert out["distinct"] == 0.0


def test_missing_word():
    out = score(LINE0, "Share a warm cup with a good neighbor today!")
    assert out["has_word"] == 0.5
    assert out["reward"] == pytest.approx((NUM_CHECKS - 1) / NUM_CHECKS)
    assert out["success"] == 0.0


def test_word_must_be_a_whole_word():
    assert not line_checks("Share a warm cup with a friendly neighbor!", "friend")["has_word"]
    assert line_checks("Share a warm cup with a FRIEND, neighbor!", "friend")["has_word"]


def test_missing_bang_and_multiline():
    out = score(LINE0.rstrip("!") + ".", "Share a warm cup\nwith a good friend today!")
    assert out["ends_with_bang"] == 0.5
    assert out["single_line"] == 0.5
    assert out["reward"] == pytest.approx((NUM_CHECKS - 2) / NUM_CHECKS)


def test_empty_lines():
    out = score("", "")
    assert out["single_line"] == out["length_ok"] == out["has_word"] == out["ends_with_bang"] == 0.0
    assert out["distinct"] == 1.0  # nothing shared
    assert out["reward"] == pytest.approx(1 / NUM_CHECKS)


def test_batch_of_joint_actions_uses_each_task():
    other = {"topic": "a bakery", "word0": "bread", "word1": "smile"}
    out = reward(
        [
            [LINE0, LINE0, "Warm bread for the whole street today!"],
            [LINE1, LINE1, "Come inside and leave with a smile!"],
        ],
        [TASK, other, other],
    )
    assert set(out) == LEVELS
    assert all(len(v) == 3 for v in out.values())
    assert out["success"] == [1.0, 0.0, 1.0]
    assert out["has_word"] == [1.0, 0.0, 1.0]
    assert out["reward"][1] == pytest.approx((NUM_CHECKS - 2) / NUM_CHECKS)
