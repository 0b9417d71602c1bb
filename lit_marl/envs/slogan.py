"""Two-line slogan: a cooperative writing task with a level-based joint reward (the quickstart).

Each agent writes one line of a slogan on a shared topic; line i must contain the task's word i.
Every rule is bounded on both sides (a one-word "Word!" or a repeated word scores nothing), as an
unbounded rule reward is hacked within minutes (../shared/notes/learning-signal.md).

Per line: a single line; 6 to 12 words with at least 5 distinct; contains its word; ends with "!".
Jointly: the two lines are different (word-set Jaccard at most 0.5), so one agent cannot copy
the other. Reward = fraction of checks passed, in [0, 1]; ``success`` = all checks passed.
"""

from __future__ import annotations

import re

MIN_WORDS, MAX_WORDS, MIN_DISTINCT = 6, 12, 5
MAX_OVERLAP = 0.5


def _words(line: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", line.lower())


def line_checks(line: str, word: str) -> dict[str, bool]:
    text = line.strip()
    words = _words(text)
    return {
        "single_line": bool(text) and "\n" not in text,
        "length_ok": MIN_WORDS <= len(words) <= MAX_WORDS and len(set(words)) >= MIN_DISTINCT,
        "has_word": word.lower() in words,
        "ends_with_bang": text.endswith("!"),
    }


def distinct(lines: list[str]) -> bool:
    sets = [set(_words(line)) for line in lines]
    for a in range(len(sets)):
        for b in range(a + 1, len(sets)):
            union = sets[a] | sets[b]
            if union and len(sets[a] & sets[b]) / len(union) > MAX_OVERLAP:
                return False
    return True


def reward(agent_completions: list[list[str]], tasks: list[dict]) -> dict[str, list[float]]:
    """Joint reward of every joint action; each level is also reported as its own metric."""
    out: dict[str, list[float]] = {"reward": [], "success": [], "distinct": []}
    for j, task in enumerate(tasks):
        lines = [agent[j] for agent in agent_completions]
        checks = [line_checks(line, task[f"word{i}"]) for i, line in enumerate(lines)]
        joint = distinct(lines)
        passed = [v for c in checks for v in c.values()] + [joint]
        out["reward"].append(sum(passed) / len(passed))
        out["success"].append(float(all(passed)))
        out["distinct"].append(float(joint))
        for name in checks[0]:
            out.setdefault(name, []).append(sum(c[name] for c in checks) / len(checks))
    return out


reward.reward_range = (0.0, 1.0)  # a fraction of checks (CoMLRL's metadata: fixed histogram bins)
