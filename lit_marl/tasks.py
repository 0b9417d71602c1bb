"""Task rows: task files (JSONL/JSON/CSV/Parquet through ``datasets``), prompt template fields,
import paths of user functions, and the seeded, resumable, rank-sharded order training visits them in."""

from __future__ import annotations

import importlib
import json
import math
import os
import string
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lit_marl import ConfigError


def import_object(path: str, field: str):
    """``package.module:name`` or ``package.module.name`` -> the object, or a clear error."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}={path!r}: give an import path like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field}={path!r}: cannot import module {module_name!r} ({err})") from err
    if not hasattr(module, attr):
        raise ConfigError(f"{field}={path!r}: module {module_name!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ConfigError(f"{field}={path!r} is not callable")
    return obj


def template_fields(template: str) -> set[str]:
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}


def _read_jsonl(path: Path, field: str) -> tuple[list[dict], list[int]]:
    """The rows of a JSONL file and the line each came from; blank lines are skipped; a line that is
    not UTF-8 or not one JSON object is an error naming it."""
    rows, lines = [], []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"{field}={str(path)!r}, line {number}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                    f"{err.start + 1}); re-save the file as UTF-8"
                ) from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{field}={str(path)!r}, line {number}: not JSON ({err.msg} at column {err.colno}): "
                    f"{text.strip()[:80]!r}"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{field}={str(path)!r}, line {number}: a JSON {type(row).__name__}, not an object of fields "
                    '(one task per line, e.g. {"topic": "tea"})'
                )
            rows.append(row)
            lines.append(number)
    return rows, lines


def load_tasks(path: str, field: str, required: set[str], needed_by: str = "data.agent_prompts") -> list[dict]:
    """Rows of a local JSONL/JSON/CSV/Parquet file (through ``datasets``), checked for ``required``
    (the fields ``needed_by`` uses: present and not null in every row) and for duplicated ``id`` /
    ``task_id`` values. Every problem is one ``ConfigError`` naming the file (and the line or row)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{field}={path!r}: file not found")
    import datasets

    kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(file.suffix)
    if kind is None:
        raise ConfigError(f"{field}={path!r}: use a .jsonl, .json, .csv or .parquet file")
    if file.stat().st_size == 0:
        raise ConfigError(f"{field}={path!r} is empty (0 bytes): give a file with one task per row")
    datasets.disable_progress_bars()
    where = "line"
    try:
        if file.suffix == ".jsonl":
            rows, places = _read_jsonl(file, field)
            names = list(dict.fromkeys(name for row in rows for name in row))  # every row's fields, in order
            # one schema over the rows (a field a row lacks is null), as load_dataset gives
            ds = datasets.Dataset.from_dict({name: [row.get(name) for row in rows] for name in names})
        else:
            if kind in ("json", "csv"):
                data = file.read_bytes()
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as err:
                    line = data[: err.start].count(b"\n") + 1
                    raise ConfigError(
                        f"{field}={path!r}, line {line}: not UTF-8 text; re-save the file as UTF-8"
                    ) from None
                if kind == "csv" and sum(bool(line.strip()) for line in data.splitlines()) <= 1:
                    raise ConfigError(f"{field}={path!r} holds no rows (a header at most)")
            ds = datasets.load_dataset(kind, data_files=path, split="train")
            places, where = list(range(1, len(ds) + 1)), "row"
    except ConfigError:
        raise
    except Exception as err:
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ConfigError(
            f"{field}={path!r}: cannot be read as {file.suffix[1:]} ({type(err).__name__}: {detail})"
        ) from None
    if len(ds) == 0:
        raise ConfigError(f"{field}={path!r} holds no rows")
    missing = sorted(required - set(ds.column_names))
    if missing:
        raise ConfigError(
            f"{field}={path!r} lacks the field(s) {missing} that {needed_by} uses; its fields are {ds.column_names}"
        )
    rows = ds.to_list()
    for row, place in zip(rows, places):
        empty = sorted(name for name in required if row.get(name) is None)
        if empty:
            raise ConfigError(
                f"{field}={path!r}, {where} {place}: no value for {empty} (missing or null), which {needed_by} uses"
            )
    for key in ("id", "task_id"):
        seen: dict = {}
        for row, place in zip(rows, places):
            value = row.get(key)
            if value is not None and value in seen:
                raise ConfigError(
                    f"{field}={path!r}: {key} {value!r} appears twice ({where}s {seen[value]} and {place}); task ids "
                    "must be unique (results and caches are kept per task)"
                )
            seen[value] = place
    return rows


def mixture(rows: list[dict], types: list[str], field: str, group_field: str = "task_type") -> list[dict]:
    """The rows whose ``group_field`` is one of ``types``, the rarer types' rows repeated (cycled)
    until every type has as many as the most common: an epoch then samples the types in equal
    shares (the guide's task-type mixture). A type without rows is an error naming ``field``."""
    missing = [row for row in rows if group_field not in row]
    if missing:
        raise ConfigError(f"{field}: the task rows need a {group_field!r} field to be mixed by it")
    by_type = {kind: [row for row in rows if row[group_field] == kind] for kind in types}
    empty = [kind for kind, members in by_type.items() if not members]
    if empty:
        present = sorted({row[group_field] for row in rows})
        raise ConfigError(f"{field}: no task rows of {empty}; the rows hold {present}")
    most = max(len(members) for members in by_type.values())
    return [members[i % len(members)] for members in by_type.values() for i in range(most)]


def task_loader(tasks: list[dict], batch_size: int, shuffle: bool, seed: int) -> DataLoader:
    """Task rows in batches (plain lists of dicts); the order is seeded."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(tasks, batch_size=batch_size, shuffle=shuffle, collate_fn=list, generator=generator)


class TaskLoader:
    """Training task rows in batches: a seeded order per epoch, sharded over ranks, resumable.

    Epoch e visits the tasks in a permutation drawn from ``seed + e`` (the same on every rank). Each
    step takes the next ``batch_size * world_size`` rows of it and rank r keeps its r-th slice of
    ``batch_size``, so W ranks with batch size B see exactly the tasks of one process with batch size
    W * B. With several ranks the permutation is padded with its own first rows to whole steps, so
    every rank takes the same number of steps. Lightning sees a loader with ``state_dict`` and
    saves it in checkpoints: the epoch and how many batches training consumed (``consumed`` is
    counted by the data module when a batch reaches the training step, not by this iterator, which
    Lightning's fetcher runs one batch ahead); a loader loaded from it resumes after the last
    consumed batch, so a killed run repeats no task and skips none.
    """

    def __init__(
        self, tasks: list[dict], batch_size: int, seed: int, rank: int = 0, world_size: int = 1, name: str = "tasks"
    ):
        self.tasks, self.batch_size, self.seed, self.name = tasks, batch_size, seed, name
        self.rank, self.world_size = rank, world_size
        self.epoch = -1  # the epoch being iterated; the first __iter__ starts epoch 0
        self.consumed = 0  # batches of this epoch that reached the training step
        self.stop: int | None = None  # the batch where the coming epoch ends early (a spent budget); None: none
        self.epoch_length = len(self)  # batches training takes per epoch (Lightning's limit_train_batches)
        self._resume_at: int | None = None

    @property
    def num_batches(self) -> int:
        """Batches of a whole epoch."""
        step = self.batch_size * self.world_size
        return -(-len(self.tasks) // step)

    def __len__(self) -> int:
        return self.num_batches if self.stop is None else min(self.num_batches, self.stop)

    def end_after(self, rows: int | None) -> None:
        """Let an epoch serve about ``rows`` rows over all ranks, counted from its start and rounded
        up to whole steps (a budget that ends mid-permutation); None: the whole permutation."""
        self.stop = None if rows is None else math.ceil(rows / (self.batch_size * self.world_size))

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        # torch's DataLoader draws a worker seed from its generator before shuffling: drawing it too
        # keeps epoch 0 in the order of the runs measured with that loader (docs/quickstart.md)
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = torch.randperm(len(self.tasks), generator=generator).tolist()
        if self.world_size > 1:
            whole = self.num_batches * self.batch_size * self.world_size
            order = (order * (whole // len(order) + 1))[:whole]
        return order

    def __iter__(self):
        if self._resume_at is None:
            self.epoch, start = self.epoch + 1, 0
        else:
            start, self._resume_at = self._resume_at, None
        self.consumed = start
        order = self.order(self.epoch)
        for b in range(start, len(self)):
            yield self.rows_of(order, b)

    def rows_of(self, order: list[int], batch: int) -> list[dict]:
        """This rank's rows of batch ``batch`` of an epoch visiting the rows in ``order``."""
        step = self.batch_size * self.world_size
        rows = order[batch * step : (batch + 1) * step]
        return [self.tasks[i] for i in rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]]

    def drawn(self, draw: int) -> list[dict]:
        """This rank's rows of batch ``draw`` of an endless walk through the rows, epoch after epoch each
        in its seeded order: batches named by their count rather than iterated, so whoever keeps the count
        (in its checkpoint) resumes the same walk."""
        epoch, batch = divmod(draw, self.num_batches)
        return self.rows_of(self.order(epoch), batch)

    def upcoming(self) -> list[dict] | None:
        """This rank's rows of the batch after the last consumed one, if this epoch trains it (None: the
        epoch ends first): what a rollout generated ahead plays (``data.max_staleness``)."""
        if self.consumed >= min(self.epoch_length, len(self)):
            return None
        return self.rows_of(self.order(self.epoch), self.consumed)

    def state_dict(self) -> dict:
        done = self.consumed >= min(self.epoch_length, len(self))
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "epoch_done": done,
            "num_tasks": len(self.tasks),
            "rows": self.name,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows", "tasks") != self.name:
            # the other phase's loader (demonstrations <-> tasks), saved as its last epoch ended: start afresh
            return
        if state["num_tasks"] != len(self.tasks):
            raise ValueError(
                f"the checkpoint's run had {state['num_tasks']} training tasks, this one {len(self.tasks)}: resume "
                "with the same data.train_path"
            )
        if state["epoch_done"]:  # saved at the end of an epoch: the next one starts afresh
            self.epoch, self._resume_at = state["epoch"], None
        else:
            self.epoch, self._resume_at = state["epoch"], state["consumed"]


def write_atomic(out: Path, text: str) -> None:
    """Write under a name of this process's own, then rename: a killed run leaves no half-written
    file, and two processes writing the same file never mix their bytes."""
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    partial.write_text(text)
    partial.replace(out)
