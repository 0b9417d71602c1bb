"""Generate seeded TextWorld game sets by complexity and write a task JSONL per split.

    .venv/bin/python scripts/make_textworld_games.py --complexity w2-o3-q4 --split train=64 test=32
    .venv/bin/python scripts/make_textworld_games.py --guide --split train=8 validation=8 test=8

Games go to ``<root>/<complexity>/<seed>.z8`` (default root ``data/textworld``) and are reused when
they exist; the task rows to ``<root>/<complexity>/<split>.jsonl``. Seeds: the guide's disjoint
ranges (train 50001-55000, validation 40001-40100, test 1-100). Prints the generation time per game.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from lit_marl.envs.textworld.games import GUIDE_COMPLEXITIES, write_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--complexity", nargs="+", default=["w2-o3-q4"], help="wW-oO-qQ[-bB] or tw-simple-<rewards>")
    parser.add_argument("--guide", action="store_true", help="every complexity of the guide")
    parser.add_argument("--split", nargs="+", default=["train=64", "test=32"], help="split=count ...")
    parser.add_argument("--root", type=Path, default=Path("data/textworld"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    complexities = list(GUIDE_COMPLEXITIES) if args.guide else args.complexity
    for complexity in complexities:
        for item in args.split:
            split, _, count = item.partition("=")
            start = time.perf_counter()
            out = write_tasks(complexity, split, int(count or 1), args.root, args.workers)
            seconds = time.perf_counter() - start
            per_game = seconds / int(count or 1)
            print(f"{complexity} {split}: {count} games in {seconds:.1f} s ({per_game:.2f} s/game) -> {out}")


if __name__ == "__main__":
    main()
