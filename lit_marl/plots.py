"""``lit-marl plot RUN_DIR [RUN_DIR ...]``: the curves of runs' TensorBoard (or CSV) logs, drawn to one PNG.

A RUN_DIR is a version folder holding event files (``lightning_logs/quickstart/version_0``) or a
CSVLogger's ``metrics.csv``, or a folder above some: then each subfolder holding them is a run, so
``lit-marl plot lightning_logs/quickstart`` overlays every version. The default panels, in order
(only those with data in some run): ``train/reward`` (shaded ± ``train/reward_std``), the per-turn
rewards ``turn_<k>/reward`` (one panel, one line per turn and run), each ``eval/<x>`` metric (``eval/reward`` and
``eval/success`` first; the per-turn ``eval/turn_<k>/<x>`` only through ``--tags``), the loss
(``train/loss``, else each learner's ``agent<i>/loss``), ``perf/tokens_per_s``. ``--tags GLOB ...``
draws one panel per matching tag instead; ``--average REGEX`` draws the runs whose labels differ
only by REGEX (seeds) as their mean with a band from the lowest to the highest. Older tag names
(``train/turn<k>/reward``, ``val/<x>``, ``heldout/<x>``, ``train/loss_agent<i>``,
``rollout/tokens_per_s``) are read as the current ones.

Entry layer: only the standard library, matplotlib and tensorboard (drawn with the Agg canvas, no
display, no pyplot state).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from lit_marl import ConfigError

EVENT_GLOB = "events.out.tfevents.*"
CSV_LOG = "metrics.csv"  # Lightning's CSVLogger: a column per tag, a row per logging call, x in "step"
TURN_REWARD = re.compile(r"turn_(\d+)/reward")
LEARNER_LOSS = re.compile(r"(agent\d+|shared|critic)/loss")
# older tag name -> the current one
_RENAMES = [
    (re.compile(r"train/turn(\d+)/(.+)"), r"turn_\1/\2"),
    (re.compile(r"(?:val|heldout)/(.+)"), r"eval/\1"),
    (re.compile(r"train/loss_(agent\d+|shared|critic)"), r"\1/loss"),
    (re.compile(r"rollout/tokens_per_s"), r"perf/tokens_per_s"),
]
_TURN_STYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P"]
_FEW_POINTS = 12  # a series this short gets markers: its points are the data, not a curve


def canonical_tag(tag: str) -> str:
    """The current name of a tag (older names map to the panel they feed)."""
    for pattern, repl in _RENAMES:
        if pattern.fullmatch(tag):
            return pattern.sub(repl, tag)
    return tag


Series = list[tuple[int, float]]  # (step, value)


@dataclass
class Run:
    path: Path
    label: str
    scalars: dict[str, Series]  # by canonical tag
    names: dict[str, str]  # canonical tag -> the tag as logged
    spread: dict[str, tuple[Series, Series]] = field(default_factory=dict)  # an average's lowest, highest run


@dataclass
class Panel:
    title: str
    tags: list[str]  # canonical tags drawn in it (several: one line per turn)
    markers: bool = False
    band: str | None = None  # tag of a std drawn as a band around the line


@dataclass
class PlotResult:
    out: Path
    panels: list[str]
    lines: dict[str, int] = field(default_factory=dict)  # panel title -> lines drawn in it
    runs: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- reading
def find_runs(run_dir: str | os.PathLike) -> list[Path]:
    """The run folders of one RUN_DIR argument: itself if it holds event files or a CSVLogger's
    ``metrics.csv``, else every subfolder (at any depth) that does, sorted."""
    path = Path(run_dir)
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r}: no such directory")
    if any(path.glob(EVENT_GLOB)) or (path / CSV_LOG).is_file():
        return [path]
    found = sorted({p.parent for pattern in (EVENT_GLOB, CSV_LOG) for p in path.rglob(pattern) if p.is_file()})
    if not found:
        raise ConfigError(
            f"RUN_DIR {str(run_dir)!r}: no TensorBoard event files ({EVENT_GLOB}) or {CSV_LOG} in it or its subfolders"
        )
    return found


def load_scalars(run: Path) -> tuple[dict[str, Series], dict[str, str]]:
    """Every scalar point of a run folder, by canonical tag (where an old and a new name both
    occur, the new one wins), and the logged name of each."""
    if not any(run.glob(EVENT_GLOB)):
        return _csv_scalars(run / CSV_LOG)
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(run), size_guidance={SCALARS: 0})
    events.Reload()
    scalars: dict[str, Series] = {}
    names: dict[str, str] = {}
    for tag in events.Tags()["scalars"]:
        name = canonical_tag(tag)
        if name in scalars and names[name] == name:  # the current name is already there
            continue
        scalars[name] = [(e.step, e.value) for e in events.Scalars(tag)]
        names[name] = tag
    return scalars, names


def _csv_scalars(path: Path) -> tuple[dict[str, Series], dict[str, str]]:
    """``load_scalars`` of a CSVLogger's file: each column's filled cells against the row's ``step``."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    scalars: dict[str, Series] = {}
    names: dict[str, str] = {}
    for tag in rows[0].keys() if rows else ():
        name = canonical_tag(tag)
        if tag == "step" or (name in scalars and names[name] == name):
            continue
        points = [(int(float(r["step"])), float(r[tag])) for r in rows if r.get(tag) not in (None, "")]
        if points:
            scalars[name], names[name] = points, tag
    return scalars, names


def load_runs(run_dirs: list[str], labels: list[str] | None = None) -> list[Run]:
    paths = [p for d in run_dirs for p in find_runs(d)]
    if labels is not None and len(labels) != len(paths):
        listed = ", ".join(str(p) for p in paths)
        raise ConfigError(
            f"--labels: {len(labels)} given for {len(paths)} run(s) ({listed}): give one label per run, in this "
            "order, or name only the runs to draw as RUN_DIRs (their version folders); without --labels each run "
            "is labelled by its folder"
        )
    if labels is None:
        labels = _default_labels(paths)
    runs = []
    for path, label in zip(paths, labels):
        scalars, names = load_scalars(path)
        runs.append(Run(path, label, scalars, names))
    return runs


def _default_labels(paths: list[Path]) -> list[str]:
    if len(paths) == 1:
        return [paths[0].resolve().name or str(paths[0])]
    resolved = [p.resolve() for p in paths]
    common = Path(os.path.commonpath(resolved))
    parts = [p.relative_to(common).parts if p != common else (p.name,) for p in resolved]
    while all(len(q) > 1 and q[-1] == parts[0][-1] for q in parts):  # the same tail (logs/version_0): left out
        parts = [q[:-1] for q in parts]
    return [str(Path(*q)) for q in parts]


def average_runs(runs: list[Run], pattern: str) -> list[Run]:
    """Runs whose labels are equal once ``pattern`` (a regex, e.g. ``-s[0-9]+`` for a seed) is taken
    out of them, as one run each: at every step all of them logged, their mean, and the lowest and
    highest of them as its band; labelled ``<label> (mean of N)``. Runs that match alone stay as
    they are."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"--average {pattern!r}: not a regular expression ({err})") from None
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(regex.sub("", run.label), []).append(run)
    if all(len(members) == 1 for members in groups.values()):
        listed = ", ".join(r.label for r in runs)
        raise ConfigError(f"--average {pattern!r}: no two runs' labels are equal without it ({listed})")
    return [members[0] if len(members) == 1 else _mean_run(label, members) for label, members in groups.items()]


def _mean_run(label: str, members: list[Run]) -> Run:
    scalars, spread, names = {}, {}, {}
    for tag in set.intersection(*(set(r.scalars) for r in members)):
        by_step = [dict(r.scalars[tag]) for r in members]
        steps = sorted(set.intersection(*(set(points) for points in by_step)))
        if not steps:
            continue
        values = [[points[s] for points in by_step] for s in steps]
        scalars[tag] = [(s, sum(v) / len(v)) for s, v in zip(steps, values)]
        spread[tag] = ([(s, min(v)) for s, v in zip(steps, values)], [(s, max(v)) for s, v in zip(steps, values)])
        names[tag] = members[0].names[tag]
    path = Path(os.path.commonpath([str(r.path) for r in members]))  # as given: no machine path in a title
    return Run(path, f"{label} (mean of {len(members)})", scalars, names, spread)


# --------------------------------------------------------------------------- choosing the panels
def default_panels(runs: list[Run]) -> list[Panel]:
    tags = set().union(*(r.scalars for r in runs))
    panels = []
    if "train/reward" in tags:
        panels.append(Panel("train/reward", ["train/reward"], band="train/reward_std"))
    turns = sorted((t for t in tags if TURN_REWARD.fullmatch(t)), key=lambda t: int(TURN_REWARD.fullmatch(t)[1]))
    if turns:
        panels.append(Panel("turn_*/reward", turns))
    # eval/<x>, the reward and success first; the per-turn eval/turn_<k>/<x> only through --tags
    evals = sorted((t for t in tags if t.startswith("eval/") and t.count("/") == 1), key=_eval_order)
    panels += [Panel(t, [t], markers=True) for t in evals]
    if "train/loss" in tags:
        panels.append(Panel("train/loss", ["train/loss"]))
    else:
        panels += [Panel(t, [t]) for t in sorted(t for t in tags if LEARNER_LOSS.fullmatch(t))]
    if "perf/tokens_per_s" in tags:
        panels.append(Panel("perf/tokens_per_s", ["perf/tokens_per_s"]))
    return panels


def _eval_order(tag: str) -> tuple[int, str]:
    first = ("eval/reward", "eval/success")
    return (first.index(tag) if tag in first else len(first), tag)


def matching_panels(runs: list[Run], patterns: list[str]) -> list[Panel]:
    """One panel per tag matching a glob (on its current or its logged name), in the order of
    the patterns, sorted within each."""
    panels, seen = [], set()
    for pattern in patterns:
        matched = {
            tag
            for run in runs
            for tag, logged in run.names.items()
            if fnmatchcase(tag, pattern) or fnmatchcase(logged, pattern)
        }
        for tag in sorted(matched - seen):
            panels.append(Panel(tag, [tag], markers=tag.startswith("eval/")))
            seen.add(tag)
    return panels


# --------------------------------------------------------------------------- drawing
def build_figure(runs: list[Run], panels: list[Panel], title: str):
    """A matplotlib Figure (Agg canvas) with one subplot per panel, and the number of lines drawn
    in each panel (by title)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.6 * nrows + 0.9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    lines: dict[str, int] = {}
    for ax, panel in zip(axes, panels):
        count = 0
        for r, run in enumerate(runs):
            for k, tag in enumerate(panel.tags):
                if run.scalars.get(tag):
                    _draw(ax, panel, run, tag, r, k, several_runs=len(runs) > 1)
                    count += 1
        lines[panel.title] = count
        shown = panel.title + (f"  (± {panel.band.split('/')[-1]})" if panel.band and _has(runs, panel.band) else "")
        ax.set_title(shown, fontsize=11)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        low, high = ax.get_xlim()
        if high - low < 2:  # one step (an eval at one point): whole steps around it, not 1.9 .. 2.1
            ax.set_xlim((low + high) / 2 - 1, (low + high) / 2 + 1)
        ax.grid(True, alpha=0.3)
        if len(panel.tags) > 1:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=13)
    if len(runs) > 1:
        handles = [
            Line2D([], [], color=f"C{i % 10}", lw=2, marker=_MARKERS[i % len(_MARKERS)], mfc="none", label=r.label)
            for i, r in enumerate(runs)
        ]
        fits = int(5.2 * ncols * 13 // (max(len(r.label) for r in runs) + 4))  # ~13 legend characters an inch
        fig.legend(handles=handles, loc="outside lower center", ncols=max(1, min(len(runs), 6, fits)), fontsize=9,
                   frameon=False)  # fmt: skip
    return fig, lines


def _draw(ax, panel: Panel, run: Run, tag: str, r: int, k: int, several_runs: bool) -> None:
    """One run's (``r``-th) line of one tag (the ``k``-th of the panel): a colour per run, or per
    turn in a one-run panel of several turns (then a dash style per turn where runs are several)."""
    points = run.scalars[tag]
    steps, values = [s for s, _ in points], [v for _, v in points]
    several = len(panel.tags) > 1
    style = _TURN_STYLES[k % len(_TURN_STYLES)] if several and several_runs else "-"
    color = f"C{k % 10}" if several and not several_runs else f"C{r % 10}"
    # a shape per run: the points of runs that coincide stay visible
    marker = _MARKERS[r % len(_MARKERS)] if panel.markers or len(points) <= _FEW_POINTS else None
    label = tag.split("/")[0] if several else run.label
    if several and several_runs:
        label = f"{run.label} {label}"
    ax.plot(steps, values, style, color=color, marker=marker, ms=5, mfc="none", label=label, lw=1.6)
    if tag in run.spread:  # an average: from its lowest to its highest run
        (low, high) = run.spread[tag]
        ax.fill_between(steps, [v for _, v in low], [v for _, v in high], color=color, alpha=0.18, lw=0)
    elif panel.band and panel.band in run.scalars:
        std = dict(run.scalars[panel.band])
        rows = [(s, v, std[s]) for s, v in points if s in std]
        if rows:
            xs = [s for s, _, _ in rows]
            ax.fill_between(xs, [v - d for _, v, d in rows], [v + d for _, v, d in rows], color=color, alpha=0.18, lw=0)


def _has(runs: list[Run], tag: str) -> bool:
    return any(tag in r.scalars for r in runs)


def plot(
    run_dirs: list[str],
    out: str | os.PathLike | None = None,
    tags: list[str] | None = None,
    labels: list[str] | None = None,
    average: str | None = None,
) -> PlotResult:
    """Draws the runs under ``run_dirs`` to ``out`` (default ``RUN_DIR/curves.png`` for one
    argument, else ``curves.png`` here); ``average``: see ``average_runs``."""
    if not run_dirs:
        raise ConfigError("RUN_DIR: give at least one run folder")
    runs = load_runs(run_dirs, labels)
    if average is not None:
        runs = average_runs(runs, average)
    panels = matching_panels(runs, tags) if tags else default_panels(runs)
    panels = [p for p in panels if any(r.scalars.get(t) for r in runs for t in p.tags)]
    if not panels:
        found = sorted(set().union(*(r.names.values() for r in runs)))
        listed = ", ".join(found) if found else "none"
        what = f"--tags {' '.join(tags)}: no tag matches" if tags else "RUN_DIR: none of the default panels has data"
        raise ConfigError(f"{what} (scalar tags in the runs: {listed})")
    if out is None:
        out = Path(run_dirs[0]) / "curves.png" if len(run_dirs) == 1 else Path("curves.png")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = _title(runs, run_dirs)
    fig, lines = build_figure(runs, panels, title)
    fig.savefig(out, dpi=100)
    return PlotResult(out, [p.title for p in panels], lines, [r.label for r in runs])


def _title(runs: list[Run], run_dirs: list[str]) -> str:
    if len(runs) == 1:
        return f"lit-marl: {runs[0].label if runs[0].spread else runs[0].path}"
    common = os.path.commonpath([str(r.path.resolve()) for r in runs])
    where = run_dirs[0] if len(run_dirs) == 1 else os.path.relpath(common)
    return f"lit-marl: {where} ({len(runs)} runs)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-marl plot",
        description="Draw runs' TensorBoard curves to a PNG. A RUN_DIR is a version folder or a folder "
        "above some (then every version under it is overlaid).",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folder(s) holding TensorBoard event files")
    parser.add_argument("--out", help="PNG to write (default: RUN_DIR/curves.png for one RUN_DIR, else ./curves.png)")
    parser.add_argument(
        "--tags", nargs="+", metavar="GLOB", help="draw these tags (fnmatch globs) instead of the defaults"
    )
    parser.add_argument("--labels", nargs="+", metavar="LABEL", help="legend label of each run, in order")
    parser.add_argument(
        "--average",
        metavar="REGEX",
        help="runs whose labels are equal once REGEX is taken out (e.g. a seed: '-s[0-9]+') drawn as their mean, "
        "the band from the lowest to the highest of them",
    )
    args = parser.parse_args(argv)
    try:
        result = plot(args.run_dirs, args.out, args.tags, args.labels, args.average)
    except ConfigError as err:
        raise SystemExit(f"lit-marl plot: {err}") from None
    print(f"wrote {result.out}")
    print(f"runs: {', '.join(result.runs)}")
    print("panels: " + ", ".join(f"{p} ({result.lines[p]} lines)" for p in result.panels))
