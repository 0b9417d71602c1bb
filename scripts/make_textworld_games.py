"""Generate seeded TextWorld game sets by complexity and write a task JSONL per split.

    .venv/bin/python scripts/make_textworld_games.py --complexity w2-o3-q4 --split train=64 test=32
    .venv/bin/python scripts/make_textworld_games.py --guide --split train=8 validation=8 test=8

Games go to ``<root>/<complexity>/<seed>.z8`` (default root ``data/textworld``) and are reused when
they exist; the task rows to ``<root>/<complexity>/<split>.jsonl``. Seeds: the guide's disjoint
ranges (train 50001-55000, validation 40001-40100, test 1-100). Prints the generation time per game.

    .venv/bin/python scripts/make_textworld_games.py --config configs/scale/textworld_grpo_qwen7b.yaml --workers 16

``--config``: every named game set a config's data reads (``textworld:<complexity>:<split>:<count>``),
generated into the cache a run looks in (``$LIT_MARL_CACHE/textworld``; point ``LIT_MARL_CACHE`` at a
shared filesystem for several nodes), so the run starts with its games made instead of generating
5,000 of them on first use while its GPUs wait.
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
    parser.add_argument("--config", nargs="+", help="generate the named game sets of these configs into the cache")
    args = parser.parse_args()
    if args.config:
        return config_sets(args.config, args.workers)
    complexities = list(GUIDE_COMPLEXITIES) if args.guide else args.complexity
    for complexity in complexities:
        for item in args.split:
            split, _, count = item.partition("=")
            start = time.perf_counter()
            out = write_tasks(complexity, split, int(count or 1), args.root, args.workers)
            seconds = time.perf_counter() - start
            per_game = seconds / int(count or 1)
            print(f"{complexity} {split}: {count} games in {seconds:.1f} s ({per_game:.2f} s/game) -> {out}")


def config_sets(configs: list[str], workers: int) -> None:
    """The named TextWorld game sets of ``configs`` (data.train_path, data.val_path) into the run's cache."""
    import yaml

    from lit_marl.envs.textworld.games import default_root, resolve_source

    for config in configs:
        init = ((yaml.safe_load(Path(config).read_text()) or {}).get("data") or {}).get("init_args") or {}
        for key in ("train_path", "val_path"):
            source = str(init.get(key) or "")
            if source.startswith("textworld:"):
                start = time.perf_counter()
                out = resolve_source(source, f"data.{key}", workers)
                print(f"{config} data.{key}={source}: {time.perf_counter() - start:.1f} s -> {out} ({default_root()})")


if __name__ == "__main__":
    main()
