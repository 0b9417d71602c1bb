#!/usr/bin/env python
"""Task rows of the calculator tool task (``data.env: tools`` with ``lit_marl.envs.tool_task:calculator``):
products of two two-digit numbers, which a small model does not know by heart and the calculator
gives exactly. Train, held-out and demonstration pairs are disjoint (every unordered pair in one
split at most); each row's ``expert`` (the call, then the answer) makes its demonstration
(``scripts/make_demos.py --env tools``).

    .venv/bin/python scripts/make_tool_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT = "What is {a} * {b}? Use the calculator tool, then reply with the number only."


def main() -> None:
    pairs = [(a, b) for a in range(11, 100) for b in range(a, 100) if a % 10 and b % 10]
    random.Random(0).shuffle(pairs)
    out = Path(__file__).resolve().parent.parent / "data" / "tools"
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:256]), ("heldout", pairs[256:320]), ("demo_tasks", pairs[320:384])):
        rows = [
            {
                "id": f"mul-{a}x{b}",
                "prompt": PROMPT.format(a=a, b=b),
                "answer": a * b,
                "expert": {
                    "calls": [{"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}],
                    "answer": a * b,
                },
            }
            for a, b in part
        ]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{out / name}.jsonl: {len(rows)} tasks")


if __name__ == "__main__":
    main()
