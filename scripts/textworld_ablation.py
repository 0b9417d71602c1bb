"""The guide's TextWorld ablation grid: algorithm x reward density x SFT:RL split (one budget) x
train complexity, each run evaluated greedily on held-out test-seed games of every eval complexity.

    python scripts/textworld_ablation.py --algorithms ppo grpo rloo --densities sparse dense \\
        --splits 0:1 60:200 --budget 260 --train w2-o3-q4 --eval w2-o3-q4 w8-o3-q4 --seeds 0 1 2 \\
        --baseline --out results/textworld_ablation

A cell is one run of ``configs/textworld/<algorithm>_cpu.yaml`` (the ``*_guide.yaml`` set:
``--config-suffix guide``) with ``callbacks.PhaseSwitch`` spending the budget
(demonstrations: the walkthroughs of validation-seed games of the train complexity, so disjoint from
the train and test games). Its full config is written to ``<out>/cells/<cell>/config.yaml``: rerun a
cell with ``lit-marl fit --config`` that file. A finished cell appends its evaluations (after SFT
where it has an SFT phase, and at the end) to ``<out>/results.jsonl``; a cell already there with
the same settings is not run again, so a killed grid resumes at the cell it was in. Grids may
share ``--out`` (one process a core): a cell or SFT stage a grid runs is locked (``.<name>.lock``
beside its folder), so another grid leaves that cell to it and waits for that stage, never running
either twice. Then the table ``<out>/results.md`` (held-out success per cell and eval complexity,
mean +- std over seeds, with the number of episodes behind each figure) and the plot
``<out>/success.svg`` are rewritten.
Cells that differ only in their seed share a line; cells whose shared settings differ (another
``--set`` value or option, e.g. a sweep written into one ``--out``) get lines of their own, each
labelled with its options.
``--env alfworld`` runs the same grid on ALFWorld's generated games (``configs/alfworld/<algorithm>_cpu.yaml``;
every task type, counts given in all and divisible by 6; each row also holds the success per task type).
``--set key=value`` overrides any config entry (dotted path, YAML value), e.g. a tiny model for a
smoke run: ``--set model.init_args.model=tiny-random``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import html
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
ALGORITHMS = ("ppo", "grpo", "rloo")


def shared_settings(args) -> dict:
    """The settings every cell of one invocation shares, beside the cell's own (algorithm, density,
    split, budget, train complexity, seed); each result row records them."""
    return {"demo_cost": args.demo_cost, "sft_epochs": args.sft_epochs, "sft_learning_rate": args.sft_learning_rate,
            "train_games": args.train_games, "eval_games": args.eval_games, "eval": sorted(args.eval),
            "config_suffix": args.config_suffix, "set": list(args.set), "share_sft": args.share_sft,
            **({"env": args.env} if args.env != "textworld" else {})}  # fmt: skip


def settings_key(args) -> str:
    """A short hash of the shared settings (a rerun with others is other cells): the last part of a
    cell's name."""
    from lit_marl.fields import pre_move_key

    settings = shared_settings(args)  # a setting that moved into a group keeps its cells: hashed by its old key
    settings["set"] = [pre_move_key(key) + sep + value for key, sep, value in (s.partition("=") for s in args.set)]
    return hashlib.sha256(json.dumps(list(settings.values()), default=str).encode()).hexdigest()[:6]


def settings_label(settings: dict | None, key: str) -> str:
    """What sets a cell's shared settings apart, as its command-line options: those that differ from
    the defaults and every ``--set`` override (``-``: none). ``--eval`` is left out (the table has a
    column per eval complexity); rows written without their settings are named by the hash."""
    if settings is None:
        return f"settings {key}" if key else "-"
    defaults = shared_settings(parse_args([]))
    flags = [
        f"--{name.replace('_', '-')} {value:g}" if isinstance(value, float) else f"--{name.replace('_', '-')} {value}"
        for name, value in settings.items()
        if name not in ("eval", "set", "share_sft") and value != defaults.get(name)
    ]
    if settings.get("share_sft") is False:
        flags.append("--no-share-sft")
    if settings.get("set"):  # each key as it is written today (a row from before a move shows the new key)
        from lit_marl.fields import current_key

        flags.append(
            "--set " + " ".join(current_key(k) + sep + v for k, sep, v in (s.partition("=") for s in settings["set"]))
        )
    return " ".join(flags) or "-"


def cell_id(algorithm: str, density: str, split: str, budget: float, train: str, seed: int, settings: str) -> str:
    return f"{algorithm}-{density}-sft{split.replace(':', 'rl')}-b{budget:g}-{train}-s{seed}-{settings}"


def set_path(config: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def budget(args, split: str) -> tuple[int, int]:
    """A split's demonstrations and RL episodes under the grid's budget (``PhaseSwitch``'s arithmetic)."""
    from lit_marl.callbacks.phase_switch import PhaseSwitch

    switch = PhaseSwitch(budget=args.budget, split=split, demo_cost=args.demo_cost)
    return switch.demos, switch.episodes


def switch_of(trainer):
    """The run's ``PhaseSwitch`` (None for a run without one: the baseline)."""
    from lit_marl.callbacks.phase_switch import PhaseSwitch

    return next((c for c in trainer.callbacks if isinstance(c, PhaseSwitch)), None)


def timed_fit(cli) -> float:
    """Fits the built run; its wall seconds."""
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return round(time.perf_counter() - start, 1)


def cell_config(args, algorithm: str, density: str, split: str, train: str, seed: int, out: Path) -> dict:
    """The algorithm's shipped config, with this cell's data, budget and logger."""
    base = REPO / "configs" / args.env / f"{algorithm}_{args.config_suffix}.yaml"
    config = yaml.safe_load(base.read_text())
    demos, _ = budget(args, split)
    data = config["data"]["init_args"]
    data.update(train_path=game_set(args.env, train, "train", args.train_games), val_path=None, reward_density=density)
    data["demos"] = {**data.get("demos", {}), "path": game_set(args.env, train, "validation", demos) if demos else None}
    trainer = config["trainer"]
    trainer.update(max_epochs=-1, limit_train_batches=None, limit_val_batches=0, check_val_every_n_epoch=None)
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(out), "name": "logs"},
    }
    switch = {"budget": args.budget, "split": split, "demo_cost": args.demo_cost, "sft_epochs": args.sft_epochs}
    if args.sft_learning_rate:
        switch["sft_learning_rate"] = args.sft_learning_rate
    trainer["callbacks"] = [{"class_path": "lit_marl.callbacks.PhaseSwitch", "init_args": switch}]
    config["seed_everything"] = seed
    for item in args.set:
        key, _, value = item.partition("=")
        set_path(config, key, yaml.safe_load(value))
    return config


def game_set(env: str, complexity: str, split: str, count: int) -> str:
    """A generated game set as a task source: TextWorld games of ``complexity``, or ALFWorld games
    (``count`` in all, as many of each of the six task types: it must divide by 6)."""
    if env == "textworld":
        return f"textworld:{complexity}:{split}:{count}"
    return f"alfworld:{split}:{count // ALFWORLD_TYPES}"


ALFWORLD_TYPES = 6  # an ALFWorld set holds as many games of each task type


@functools.cache
def eval_tasks(env: str, complexity: str, games: int) -> tuple[dict, ...]:
    """The ``games`` test-seed games of ``complexity`` (generated once, loaded once per grid)."""
    from lit_marl.tasks import load_tasks

    if env == "textworld":
        from lit_marl.envs.textworld.games import resolve_source
    else:
        from lit_marl.envs.alfworld.games import resolve_source
    source = resolve_source(game_set(env, complexity, "test", games), "--eval")
    return tuple(load_tasks(source, "--eval", set()))


def evaluate(module, data, complexity: str, games: int, env: str = "textworld") -> dict:
    """Greedy held-out success on ``games`` test-seed games of ``complexity``."""
    data.val_tasks = list(eval_tasks(env, complexity, games))
    return held_out(module, data)


def held_out(module, data) -> dict:
    """Greedy success on the data module's held-out tasks, with their count and the seconds taken
    (``scripts/credit_comparison.py`` evaluates with it too)."""
    start = time.perf_counter()
    with module.computing(), torch.random.fork_rng():  # training's random stream goes on untouched
        metrics = data.evaluate(module.agents)
    by_type = {key.partition("/")[2]: value for key, value in metrics.items() if key.startswith("won/")}
    return {
        "won": metrics["won"],
        "eval_episodes": len(data.val_tasks),
        "eval_s": round(time.perf_counter() - start, 1),
        **({"won_by_type": by_type} if by_type else {}),
    }


def after_sft(args, key: dict, rows: list[dict]):
    """A callback that evaluates the policy once, where the SFT phase hands over to RL."""
    import lightning as L

    class AfterSFT(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:  # runs after PhaseSwitch's (listed first)
            switch = switch_of(trainer)
            if switch.switched_at is None or rows or not switch.demos:
                return
            trained = {"demos": switch.demos, "train_episodes": 0, "stage": "after SFT"}
            for c in args.eval:
                rows.append({**key, **trained, "train_s": round(time.perf_counter() - self.start, 1), "eval": c,
                             **evaluate(pl_module, trainer.datamodule, c, args.eval_games, args.env)})  # fmt: skip
                print(
                    f"[ablation] after SFT -> {c}: won {rows[-1]['won']:.3f} of {rows[-1]['eval_episodes']}", flush=True
                )

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

    return AfterSFT()


@contextlib.contextmanager
def held(folder: Path, wait: bool = True):
    """This process's exclusive lock on ``folder`` (a hidden ``.<name>.lock`` beside it) while the block
    runs; yields whether it holds it: with ``wait`` it says it waits and waits for another grid to let
    go; without, it yields False at once. An flock: the kernel lets go when the process ends, killed or
    not, so no lock outlives the grid that took it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            print(f"[ablation] {folder.name}: another grid is running it; waiting for it", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield True


def build(config: dict, out: Path):
    """The cell's config written to ``out/config.yaml`` (rerunnable) and built from there."""
    from lit_marl.cli import build_cli

    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return build_cli(["--config", str(path)], run=False)


def end_rows(args, cli, key: dict, trained: dict) -> list[dict]:
    """The cell's rows at its end: the policy played greedily on the test games of each eval complexity.
    A run that ended before its budget was spent writes none (the cell runs again)."""
    switch = switch_of(cli.trainer)
    if switch is not None and (switch.phase != "rl" or switch.episodes_done < switch.episodes):
        raise RuntimeError(f"{key}: the run ended before its budget was spent ({switch.describe()})")
    evaluated = {c: evaluate(cli.model, cli.datamodule, c, args.eval_games, args.env) for c in args.eval}
    return [{**key, **trained, "eval": c, **row} for c, row in evaluated.items()]


def run_cell(args, key: dict, out: Path) -> list[dict]:
    """The cell's rows: after SFT (where it has an SFT phase) and at the end, per eval complexity."""

    config = cell_config(args, key["algorithm"], key["density"], key["split"], key["train"], key["seed"], out)
    if budget(args, key["split"])[0] and args.share_sft and config["model"]["init_args"].get("lora"):
        return run_after_shared_sft(args, key, config, out)
    cli = build(config, out)
    sft_rows: list[dict] = []
    cli.trainer.callbacks.append(after_sft(args, key, sft_rows))
    wall = timed_fit(cli)  # the after-SFT evaluation included
    switch = switch_of(cli.trainer)
    trained = {"demos": switch.demos, "train_episodes": int(switch.episodes_done), "train_s": wall, "stage": "end"}
    return sft_rows + end_rows(args, cli, key, trained)


# ---------------------------------------------------------------------------- SFT shared between cells
# What only the RL phase reads: cells that differ in these alone (and in algorithm and reward density)
# start RL from the same SFT run. Any other difference makes another SFT run.
RL_ONLY = {  # max_new_tokens is not: the evaluation after SFT reads it
    "model": ("critic_learning_rate", "gae", "ppo_epochs", "discount", "critic_warmup", "value_loss_coef",
              "clip_range", "value_clip_range", "kl_coef", "kl_mode", "kl_clamp", "kl_reference", "entropy_coef",
              "gae_lambda", "rollout_is_cap", "dual_clip", "train_batch_size", "skip_signalless_steps",
              "turn_level_advantages", "advantage_normalization", "step_advantage_weight"),
    "data": ("train_path", "reward_density", "tasks_per_step", "num_generations", "temperature", "top_p", "top_k",
             "score_weight", "anchor"),
}  # fmt: skip
RL_ONLY_GROUPED = {"update": ("sft_coef",)}  # settings born in a group (no name before a move)


def sft_stage_id(args, config: dict, switch: dict, train: str, seed: int) -> str:
    """The name of the SFT run a cell starts from: its demonstrations, passes, complexity and seed,
    and a hash of every setting SFT and its evaluation read (the cell's config without its
    algorithm, its RL-only settings, logger and callbacks; the eval games)."""
    from lit_marl.fields import ungroup_moved

    rl_only = (*RL_ONLY["model"], *(["learning_rate"] if switch.get("sft_learning_rate") else []))  # SFT's own
    # settings read by their names before any move into a group: a stage run before a move is still found
    model = {k: v for k, v in ungroup_moved("model", config["model"]["init_args"]).items() if k not in rl_only}
    for group, fields in RL_ONLY_GROUPED.items():
        kept = {k: v for k, v in model.pop(group, {}).items() if k not in fields}
        model.update({group: kept} if kept else {})
    data = {k: v for k, v in ungroup_moved("data", config["data"]["init_args"]).items() if k not in RL_ONLY["data"]}
    trainer = {k: v for k, v in config["trainer"].items() if k not in ("logger", "callbacks")}
    reads = [model, data, trainer, switch, config["seed_everything"], sorted(args.eval), args.eval_games]
    digest = hashlib.sha256(json.dumps(reads, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"sft{switch['budget']:g}x{switch['sft_epochs']}-{train}-s{seed}-{digest}"


def sft_stage_of(args, config: dict, key: dict, stages: Path) -> tuple[dict, Path]:
    """The SFT stage's phase switch (the demonstrations budget alone) and its folder under ``stages``."""
    (phase,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("PhaseSwitch")]
    switch = {**phase["init_args"], "budget": budget(args, key["split"])[0] * args.demo_cost, "split": "1:0"}
    return switch, stages / sft_stage_id(args, config, switch, key["train"], key["seed"])


def sft_stage(args, config: dict, key: dict, stages: Path) -> tuple[Path, list[dict]]:
    """The SFT run a cell starts from: run once (the demonstrations budget alone, evaluated after
    SFT, its LoRA adapters exported) and reused by every cell with the same SFT settings. Written
    last, ``after_sft.jsonl`` marks it finished; a killed stage runs again from the start."""
    switch, out = sft_stage_of(args, config, key, stages)
    with held(out):  # another grid running this stage finishes it first: it is then reused
        return run_sft_stage(args, config, switch, out)


def run_sft_stage(args, config: dict, switch: dict, out: Path) -> tuple[Path, list[dict]]:
    """``sft_stage`` under its lock: run unless finished (its rows and its adapters both there)."""
    done = out / "after_sft.jsonl"
    if not (done.exists() and (out / "export" / "team.json").exists()):  # git holds the rows, not the adapters
        partial = out / "export.partial"
        stage = json.loads(json.dumps(config))
        stage["trainer"]["callbacks"] = [
            {"class_path": "lit_marl.callbacks.PhaseSwitch", "init_args": switch},
            {"class_path": "lit_marl.callbacks.HFExport", "init_args": {"dirpath": str(partial), "lora": "adapter"}},
        ]
        stage["trainer"]["logger"]["init_args"]["save_dir"] = str(out)
        cli = build(stage, out)
        rows: list[dict] = []
        cli.trainer.callbacks.append(after_sft(args, {}, rows))
        seconds = timed_fit(cli)
        if not rows:
            raise RuntimeError(f"{out.name}: the SFT run ended before its switch (its phase line says why)")
        for row in rows:
            row["sft_s"] = seconds
        shutil.rmtree(out / "export", ignore_errors=True)  # a stage killed after its rename
        partial.replace(out / "export")
        done.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out, load_rows(done)


def learns_demos(config: dict) -> bool:
    """Whether a cell's RL steps keep learning the demonstrations (``model.update.sft_coef``)."""
    return bool((config["model"]["init_args"].get("update") or {}).get("sft_coef"))


def run_after_shared_sft(args, key: dict, config: dict, out: Path) -> list[dict]:
    """A cell as two runs: its SFT stage (shared, ``sft_stage``) then RL from the stage's adapters
    (``InitialWeights``) with the RL share of the budget; its config.yaml is the RL run's."""

    stage, sft_rows = sft_stage(args, config, key, out.parent.parent / "sft")
    demos, episodes = budget(args, key["split"])
    sft_s = sft_rows[0]["sft_s"]
    after = [{**row, **key, "demos": demos, "train_s": sft_s, "sft_stage": stage.name} for row in sft_rows]
    if not episodes:  # SFT only: the end is where SFT left it
        return after + [{**row, "stage": "end"} for row in after]
    if not learns_demos(config):  # RL that keeps learning the demonstrations keeps them
        config["data"]["init_args"]["demos"]["path"] = None
    config["trainer"]["callbacks"] = [
        {"class_path": "lit_marl.callbacks.InitialWeights", "init_args": {"path": str(stage / "export")}},
        {"class_path": "lit_marl.callbacks.PhaseSwitch", "init_args": {"budget": episodes, "split": "0:1"}},
    ]
    cli = build(config, out)
    rl_s = timed_fit(cli)
    switch = switch_of(cli.trainer)
    trained = {"demos": demos, "train_episodes": int(switch.episodes_done), "train_s": round(sft_s + rl_s, 1),
               "sft_s": sft_s, "rl_s": rl_s, "stage": "end", "sft_stage": stage.name}  # fmt: skip
    return after + end_rows(args, cli, key, trained)


def run_baseline(args, out: Path) -> list[dict]:
    """The untrained model on every eval complexity (greedy: one run stands for every seed)."""
    config = cell_config(args, args.algorithms[0], "sparse", "0:1", args.train[0], 0, out)
    config["trainer"]["callbacks"] = []
    cli = build(config, out)
    cli.model.configure_model()
    key = {"algorithm": "base", "density": "-", "split": "-", "budget": 0, "train": "-", "seed": 0}
    trained = {"demos": 0, "train_episodes": 0, "train_s": 0.0, "stage": "base"}
    return end_rows(args, cli, key, trained)


# ---------------------------------------------------------------------------- the table and the plot
def summarize(rows: list[dict]) -> list[dict]:
    """One line per cell but its seed (algorithm, density, split, budget, train, shared settings)
    and per stage and eval complexity: success mean and std over the seeds. Cells whose shared
    settings differ (a ``--set`` sweep, another ``--sft-epochs``) are separate lines, labelled by
    ``settings_label``."""
    fields = ("algorithm", "density", "split", "budget", "train", "stage", "eval")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = row["cell"].rpartition("-")[2] if "cell" in row else ""  # the shared settings' hash
        groups.setdefault((*(row[f] for f in fields), key), []).append(row)
    lines = []
    for (*values, key), members in groups.items():
        seeds = [m["seed"] for m in members]
        if len(set(seeds)) != len(seeds):  # a seed counted twice would narrow the interval it has not earned
            raise ValueError(f"{values}: seeds {sorted(seeds)} appear twice in the results: remove the duplicate rows")
        won = [m["won"] for m in members]
        lines.append(
            {
                **dict(zip(fields, values)),
                "settings": settings_label(members[0].get("settings"), key),
                "seeds": len(members),
                "won_mean": statistics.fmean(won),
                "won_std": statistics.stdev(won) if len(won) > 1 else 0.0,
                "eval_episodes": sum(m["eval_episodes"] for m in members),
                "train_episodes": sum(m["train_episodes"] for m in members),
                "demos": members[0]["demos"],
                "train_s": statistics.fmean(m["train_s"] for m in members),
            }
        )
    return lines


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def confidence(line: dict) -> str:
    """The 95 % confidence interval of a line's mean success over its seeds (Student's t, seeds - 1
    degrees of freedom, clipped to [0, 1]); "-" for one seed."""
    n = line["seeds"]
    if n < 2:
        return "-"
    half = T_975.get(n - 1, 1.96 + 2.5 / (n - 1)) * line["won_std"] / n**0.5
    return f"[{max(line['won_mean'] - half, 0.0):.3f}, {min(line['won_mean'] + half, 1.0):.3f}]"


def table(lines: list[dict]) -> str:
    head = (
        "| algorithm | rewards | SFT:RL | budget | train | settings | stage | eval | held-out success | seeds "
        "| eval episodes | demos | RL episodes (all seeds) | train s (mean) | 95% CI of the mean |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {x['algorithm']} | {x['density']} | {x['split']} | {x['budget']:g} | {x['train']} | "
        f"{x['settings'].replace('|', chr(92) + '|')} | {x['stage']} | {x['eval']} | "
        f"{x['won_mean']:.3f} ± {x['won_std']:.3f} | {x['seeds']} | {x['eval_episodes']} | {x['demos']} | "
        f"{x['train_episodes']} | {x['train_s']:.0f} | {confidence(x)} |\n"
        for x in lines
    )
    return head + body


def svg(lines: list[dict]) -> str:
    """A bar per line (success, with its std over seeds as a whisker), grouped by eval complexity."""
    width, height, left, bottom, bar = 120 + 34 * max(len(lines), 1), 420, 60, 260, 26
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<text x="{left}" y="18" font-size="14">Held-out success (greedy) per ablation cell</text>',
        f'<line x1="{left}" y1="{bottom}" x2="{width - 20}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="40" x2="{left}" y2="{bottom}" stroke="black"/>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = bottom - tick * 220
        parts.append(f'<text x="{left - 8}" y="{y + 4:.0f}" text-anchor="end">{tick:.2f}</text>')
        parts.append(f'<line x1="{left}" y1="{y:.0f}" x2="{width - 20}" y2="{y:.0f}" stroke="#ddd"/>')
    palette = {"base": "#888888", "ppo": "#1f77b4", "grpo": "#ff7f0e", "rloo": "#2ca02c"}
    order = {"base": 0, "after SFT": 1, "end": 2}
    ranked = sorted(
        lines, key=lambda x: (x["eval"], x["algorithm"], x["density"], x["split"], x["settings"], order[x["stage"]])
    )
    for i, x in enumerate(ranked):
        cx = left + 20 + i * 34
        h = x["won_mean"] * 220
        colour = palette.get(x["algorithm"], "#9467bd")
        parts.append(f'<rect x="{cx}" y="{bottom - h:.1f}" width="{bar}" height="{h:.1f}" fill="{colour}"/>')
        if x["won_std"]:
            lo, hi = bottom - max(x["won_mean"] - x["won_std"], 0) * 220, bottom - (x["won_mean"] + x["won_std"]) * 220
            mid = cx + bar / 2
            parts.append(f'<line x1="{mid}" y1="{lo:.1f}" x2="{mid}" y2="{hi:.1f}" stroke="black"/>')
        settings = "" if x["settings"] == "-" else f" {html.escape(x['settings'])}"
        label = f"{x['algorithm']} {x['density']} {x['split']}{settings} {x['stage']} {x['train']}&#8594;{x['eval']}"
        parts.append(
            f'<text x="{cx + bar / 2}" y="{bottom + 10}" transform="rotate(60 {cx + bar / 2} {bottom + 10})">'
            f"{label}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_reports(out: Path, rows: list[dict]) -> None:
    lines = summarize(rows)
    env = "ALFWorld" if any(row.get("settings", {}).get("env") == "alfworld" for row in rows) else "TextWorld"
    (out / "results.md").write_text(
        f"# {env} ablation: held-out greedy success\n\n" + table(lines) + "\nEach figure: mean ± std over seeds "
        "of the fraction of held-out test-seed games won; eval episodes = games × seeds.\n"
    )
    (out / "success.svg").write_text(svg(lines))


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=["ppo"], choices=ALGORITHMS)
    parser.add_argument("--densities", nargs="+", default=["dense"], choices=["sparse", "dense"])
    parser.add_argument("--splits", nargs="+", default=["0:1", "60:200"], help="SFT:RL shares of the budget")
    parser.add_argument("--budget", type=float, default=260, help="cost units: one RL episode = 1")
    parser.add_argument("--demo-cost", type=float, default=1.0, help="cost of one demonstration")
    parser.add_argument("--sft-epochs", type=int, default=1, help="passes over the demonstrations")
    parser.add_argument("--sft-learning-rate", type=float, default=None)
    parser.add_argument("--env", default="textworld", choices=["textworld", "alfworld"],
                        help="the games; alfworld: every task type, its counts in all (a multiple of 6)")  # fmt: skip
    parser.add_argument("--train", nargs="+", default=None, help="train complexities (alfworld: all)")
    parser.add_argument("--eval", nargs="+", default=None, help="eval complexities (test seeds; alfworld: all)")
    parser.add_argument("--train-games", type=int, default=64)
    parser.add_argument("--eval-games", type=int, default=16)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--baseline", action="store_true", help="also evaluate the untrained model")
    parser.add_argument("--config-suffix", default="cpu", help="configs/textworld/<algorithm>_<suffix>.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides (dotted keys)")
    parser.add_argument("--out", type=Path, default=Path("results/textworld_ablation"))
    parser.add_argument(
        "--share-sft", action=argparse.BooleanOptionalAction, default=True,
        help="cells of one seed, train complexity and SFT budget start RL from one SFT run (LoRA models)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    default = ["w2-o3-q4"] if args.env == "textworld" else ["all"]
    args.train, args.eval = args.train or default, args.eval or default
    return args


def check_grid(args) -> None:
    """ConfigError where a split's demonstrations or a complexity cannot be had."""
    from lit_marl import ConfigError
    from lit_marl.callbacks.phase_switch import parse_split
    from lit_marl.envs.textworld.games import Complexity, split_seeds

    first = cell_config(args, args.algorithms[0], args.densities[0], args.splits[0], args.train[0], args.seeds[0], None)
    for split in args.splits:
        parse_split(split)
        demos, _ = budget(args, split)
        if learns_demos(first) and not demos:
            raise ConfigError(
                f"--splits {split} has no demonstrations for model.update.sft_coef to keep learning in RL: leave "
                "the split out, or run it in a grid of its own without sft_coef"
            )
        if demos and args.env == "alfworld" and demos % ALFWORLD_TYPES:
            raise ConfigError(
                f"--budget {args.budget:g} --splits {split}: {demos} demonstrations: give a multiple of 6"
            )
        if demos and args.env == "textworld":
            try:
                split_seeds("validation", demos)
            except ConfigError as err:
                raise ConfigError(f"--budget {args.budget:g} --splits {split}: {demos} demonstrations: {err}") from None
    if args.env == "alfworld" and {*args.train, *args.eval} != {"all"}:
        raise ConfigError("--train/--eval: ALFWorld games are not graded by complexity: leave them out (all)")
    if args.env == "alfworld" and (args.train_games % ALFWORLD_TYPES or args.eval_games % ALFWORLD_TYPES):
        raise ConfigError(
            "--train-games/--eval-games: ALFWorld sets hold as many games of each of 6 types: multiples of 6"
        )
    for name in [*args.train, *args.eval] if args.env == "textworld" else []:
        Complexity.parse(name, "--train/--eval")


def grid_cells(args) -> list[tuple[str, dict | None]]:
    """Every cell of the grid: its name and key (None: the baseline), in the order they run."""
    settings = settings_key(args)
    cells: list[tuple[str, dict | None]] = [(f"base-{settings}", None)] if args.baseline else []
    for algorithm, density, split, train, seed in itertools.product(
        args.algorithms, args.densities, args.splits, args.train, args.seeds
    ):
        key = {"algorithm": algorithm, "density": density, "split": split, "budget": args.budget, "train": train,
               "seed": seed}  # fmt: skip
        cells.append((cell_id(algorithm, density, split, args.budget, train, seed, settings), key))
    return cells


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from lit_marl import ConfigError

    try:
        check_grid(args)
    except ConfigError as err:
        sys.exit(f"textworld_ablation: {err}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    for name, key in grid_cells(args):
        cell_out = args.out / "cells" / name
        with held(cell_out, wait=False) as free:
            if not free:
                print(f"[ablation] {name}: another grid is running it; left to that grid", flush=True)
                continue
            if name in {row["cell"] for row in load_rows(results)}:  # read under the lock: a grid may share --out
                print(f"[ablation] {name}: done before, kept", flush=True)
                continue
            print(f"[ablation] {name} ...", flush=True)
            rows = run_baseline(args, cell_out) if key is None else run_cell(args, key, cell_out)
            with open(results, "a") as f:
                for row in rows:
                    f.write(json.dumps({"cell": name, **row, "settings": shared_settings(args)}) + "\n")
        for row in rows:
            print(f"[ablation] {name} -> {row['eval']}: won {row['won']:.3f} of {row['eval_episodes']}", flush=True)
        write_reports(args.out, load_rows(results))
    write_reports(args.out, load_rows(results))
    print(f"[ablation] table: {args.out / 'results.md'}  plot: {args.out / 'success.svg'}")
    print((args.out / "results.md").read_text())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
