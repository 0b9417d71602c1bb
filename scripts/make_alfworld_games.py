"""Write the project's ALFWorld games (tw-pddl, against the domain and grammar the ``alfworld``
package ships) and a task JSONL per split.

    .venv/bin/python scripts/make_alfworld_games.py --split train=8 validation=4 test=4
    .venv/bin/python scripts/make_alfworld_games.py --split test=2 --types pick_two_obj_and_place

``count`` games of every task type per split, seeded from the split's range (train 50001-55000,
validation 40001-40100, test 1-100: disjoint). Games go to ``<root>/<split>/<task dir>/trial_<seed>/``
(ALFWorld's own layout, with a ``traj_data.json``), the rows to ``<root>/<split>-<count>.jsonl``;
existing games are reused. The same sets are what ``data.train_path: alfworld:<split>:<count>`` makes
in the cache. Each game's walkthrough is the planner's plan, checked to win. Prints the time per game.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from lit_marl.envs.alfworld.games import TASK_TYPES, task_type, write_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", nargs="+", default=["train=8", "test=4"], help="split=count per task type ...")
    parser.add_argument("--types", nargs="+", default=list(TASK_TYPES), help="task types (default: all six)")
    parser.add_argument("--root", type=Path, default=Path("data/alfworld"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    kinds = tuple(task_type(name, "--types") for name in args.types)
    for item in args.split:
        split, _, count = item.partition("=")
        start = time.perf_counter()
        out = write_tasks(split, int(count or 1), args.root, args.workers, kinds)
        games = int(count or 1) * len(kinds)
        seconds = time.perf_counter() - start
        print(f"{split}: {games} games in {seconds:.1f} s ({seconds / games:.2f} s/game) -> {out}")


if __name__ == "__main__":
    main()
