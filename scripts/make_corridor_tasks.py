"""Task rows of the built-in Corridor game (lit_marl/envs/corridor.py): train and held-out layouts.

Every layout (length 3-7, key room, with or without the pit west of the start) appears in exactly
one split; the held-out split keeps one layout in four. ``max_steps`` is twice the shortest solution.
``demo_tasks.jsonl`` holds the layouts of length 8-10, for expert demonstrations
(``scripts/make_demos.py``): disjoint from the RL and evaluation tasks.

    python scripts/make_corridor_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lit_marl.envs.corridor import expert_actions


def layouts(lengths: range = range(3, 8)) -> list[dict]:
    rows = []
    for length in lengths:
        for pit in (False, True):
            for key in range(int(pit) + 1, length):
                row = {"length": length, "key_room": key, "pit": pit}
                row["max_steps"] = 2 * len(expert_actions(row))
                rows.append(row)
    return rows


def main() -> None:
    rows = layouts()
    random.Random(0).shuffle(rows)
    heldout, train = rows[::4], [r for i, r in enumerate(rows) if i % 4]
    out = Path(__file__).resolve().parent.parent / "data" / "corridor"
    out.mkdir(parents=True, exist_ok=True)
    # expert demonstrations for SFT (scripts/make_demos.py) come from longer corridors, a layout set
    # disjoint from both RL splits by construction
    demo = layouts(range(8, 11))
    for name, part in (("train", train), ("heldout", heldout), ("demo_tasks", demo)):
        with open(out / f"{name}.jsonl", "w") as f:
            for i, row in enumerate(part):
                f.write(json.dumps({"task_id": f"corridor/{name.removesuffix('_tasks')}/{i}", **row}) + "\n")
        print(f"{name}: {len(part)} layouts -> {out / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
