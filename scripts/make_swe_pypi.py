"""Build the PyPI SWE set: released pure-Python projects (pinned sdists) turned into SWE-Gym
instances by synthesized regressions (``lit_marl/envs/swe/pypi_set.py``), each one checked through
the real scorer. Writes the repositories, train.jsonl / test.jsonl / all.jsonl (split by project)
and manifest.json, and prints one line per project.

    python scripts/make_swe_pypi.py [--out DIR] [--projects a,b] [--seed N]   # or: make swe-pypi
    # default DIR: $LIT_MARL_CACHE/swe/pypi (~/.cache/lit_marl/swe/pypi)

Downloads each sdist once (``pip download``, into DIR/sdists); a project already built with the same
settings is reused, a half-written one built again; ``--revalidate`` checks every instance already
made again with the scorer (after the scorer changed). Runs name the set ``swe:pypi:<train|test|all>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from lit_marl.envs.swe.pypi_set import PROJECTS, SPLITS, BuildSettings, build_set
from lit_marl.models import cache_dir


def table(manifest: dict) -> str:
    head = f"{'project':<16}{'version':<10}{'split':<7}{'tests':>7}{'tried':>7}{'kept':>6}{'valid':>7}{'seconds':>9}"
    lines = [head, "-" * len(head)]
    for name, p in sorted(manifest["projects"].items()):
        if "error" in p:
            lines.append(f"{name:<16}{p['version']:<10}{p['split']:<7} skipped: {p['error'][:80]}")
            continue
        lines.append(
            f"{name:<16}{p['version']:<10}{p['split']:<7}{p['tests']:>7}{p['tried']:>7}{p['kept']:>6}"
            f"{p['validated']:>7}{p['seconds']:>9.1f}"
        )
    projects = [p for p in manifest["projects"].values() if "error" not in p]
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<33}{sum(p['tests'] for p in projects):>7}{sum(p['tried'] for p in projects):>7}"
        f"{sum(p['kept'] for p in projects):>6}{sum(p['validated'] for p in projects):>7}"
        f"{manifest['build_seconds']:>9.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=cache_dir() / "swe" / "pypi", help="the set's folder")
    parser.add_argument("--projects", default="", help="a comma-separated subset of the pinned projects")
    parser.add_argument("--seed", type=int, default=BuildSettings.seed)
    parser.add_argument("--max-kept", type=int, default=BuildSettings.max_kept, help="instances per project")
    parser.add_argument("--max-tried", type=int, default=BuildSettings.max_tried, help="mutants run per project")
    parser.add_argument("--quiet", action="store_true", help="no line per kept mutant")
    parser.add_argument(
        "--revalidate", action="store_true", help="check every instance of the built projects again with the scorer"
    )
    args = parser.parse_args(argv)
    chosen = [n for n in args.projects.split(",") if n] or list(PROJECTS)
    unknown = sorted(set(chosen) - set(PROJECTS))
    if unknown:
        parser.error(f"--projects: {unknown} are not pinned; the pinned ones: {', '.join(PROJECTS)}")
    projects = {name: PROJECTS[name] for name in chosen}
    splits = {split: [n for n in names if n in projects] for split, names in SPLITS.items()}
    settings = dataclasses.replace(BuildSettings(), seed=args.seed, max_kept=args.max_kept, max_tried=args.max_tried)
    start = time.monotonic()
    log = (lambda _: None) if args.quiet else print
    manifest = build_set(args.out, projects, splits, settings, log=log, revalidate=args.revalidate)
    print(table(manifest))
    print(
        f"validation rate {manifest['validation_rate']:.1%}; instances: "
        + ", ".join(f"{split} {n}" for split, n in manifest["counts"].items())
        + f"; build {manifest['build_seconds']:.0f} s (this run {time.monotonic() - start:.0f} s); {args.out}"
    )
    for kind, n in manifest["invalid_kinds"].items():
        print(f"  not valid ({n}): {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
