#!/usr/bin/env python
"""Rewrite YAML configs whose settings moved into groups (docs/config.md, "Moved settings"), in place,
comments and order kept: each moved key is taken out of its section and put into its group there.

    .venv/bin/python scripts/migrate_config.py my_run.yaml configs/mine/*.yaml
    .venv/bin/python scripts/migrate_config.py --check configs   # exit 1 if any file still has old keys

Each file is checked after rewriting: it must load to the same settings as the old one with its keys
regrouped (``lit_marl.fields.regroup_moved``, what a checkpoint saved before the move gets).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_marl.fields import MOVED, plain_key, regroup_moved  # noqa: E402

KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")


def moved_lines(lines: list[str]) -> list[tuple[int, str, str, str]]:
    """``(line index, indent, old dotted key without init_args, the rest of the line)`` of every
    block-mapping key line whose dotted path is a moved key."""
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    out = []
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match or line.lstrip().startswith("#"):
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = plain_key(".".join([k for _, k in stack] + [key]))
        value = rest.split(" #", 1)[0].strip()
        if path in MOVED and value and not value.startswith("{"):  # a value, not the group's own mapping
            out.append((i, match.group(1), path, rest))
        stack.append((indent, key))
    return out


def migrate_text(text: str) -> str:
    """The YAML text with every moved key put into its group (a group the section already has gets
    the key as its last entry; else the group is opened where its first moved key stood)."""
    lines = text.splitlines(keepends=True)
    found = moved_lines(lines)
    if not found:
        return text
    indents = [len(m.group(1)) for m in map(KEY.match, lines) if m and m.group(1)]
    unit = " " * (min(indents) if indents else 2)  # the file's indentation step
    inserts: dict[int, list[str]] = {}  # line index -> lines to put before it
    drop = {i for i, *_ in found}
    for i, indent, old, rest in found:
        group = MOVED[old].split(".")[-2]
        entry = f"{indent}{unit}{MOVED[old].split('.')[-1]}:{rest.rstrip()}\n"
        existing = _group_line(lines, i, indent, group, drop)
        if existing is None:
            first = min(j for j, ind, o, _ in found if ind == indent and MOVED[o].split(".")[-2] == group)
            head = f"{indent}{group}:\n"
            block = inserts.setdefault(first, [])
            if head not in block:
                block.append(head)
            block.append(entry)
        else:
            inserts.setdefault(_group_end(lines, existing, indent), []).append(entry)
    out = []
    for j, line in enumerate(lines + [""]):
        out += inserts.get(j, [])
        if j < len(lines) and j not in drop:
            out.append(line)
    return "".join(out)


def _group_line(lines, near: int, indent: str, group: str, drop: set[int]) -> int | None:
    """The line of ``group:`` at ``indent`` in the mapping that holds line ``near``, if any."""
    for j in range(len(lines)):
        if j not in drop and lines[j].startswith(f"{indent}{group}:") and _same_mapping(lines, j, near, indent):
            return j
    return None


def _same_mapping(lines, a: int, b: int, indent: str) -> bool:
    lo, hi = sorted((a, b))
    for line in lines[lo + 1 : hi]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and len(line) - len(line.lstrip()) < len(indent):
            return False
    return True


def _group_end(lines, start: int, indent: str) -> int:
    """The index after the last line of the group opened at ``start``."""
    j = start + 1
    while j < len(lines):
        stripped = lines[j].strip()
        if stripped and not stripped.startswith("#") and len(lines[j]) - len(lines[j].lstrip()) <= len(indent):
            break
        j += 1
    return j


def regrouped(config: dict) -> dict:
    """What ``config`` means after the move: each section's old keys in their groups."""
    out = dict(config)
    for section, node in config.items():
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("init_args"), dict):
            out[section] = {**node, "init_args": regroup_moved(section, node["init_args"])}
        else:
            out[section] = regroup_moved(section, node)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="YAML files, or folders searched for *.yaml")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file has moved keys")
    args = parser.parse_args(argv)
    files = [f for p in map(Path, args.paths) for f in (sorted(p.rglob("*.yaml")) if p.is_dir() else [p])]
    stale = []
    for path in files:
        text = path.read_text()
        new = migrate_text(text)
        if new == text:
            continue
        stale.append(path)
        if args.check:
            continue
        if yaml.safe_load(new) != regrouped(yaml.safe_load(text)):
            raise SystemExit(f"{path}: the rewritten file would mean something else; left as it was")
        path.write_text(new)
        print(f"{path}: moved keys regrouped")
    if args.check and stale:
        print("old keys in: " + ", ".join(map(str, stale)) + " (run scripts/migrate_config.py on them)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
