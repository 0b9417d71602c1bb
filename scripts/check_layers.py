"""Checks the house rules of docs/architecture.md on the source tree and prints what breaks them:
import circles between project modules, function-level project imports, files under lit_marl/ over
500 lines, functions there over 80 lines. Exit status 1 when anything breaks.

    .venv/bin/python scripts/check_layers.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "lit_marl").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((ROOT / "callbacks").glob("*.py")):
        name = "lit_marl.callbacks" + ("" if path.stem == "__init__" else f".{path.stem}")
        files[name] = path
    return files


def imports(tree: ast.Module, modules: set[str], top_level: bool) -> list[tuple[int, str]]:
    """(line, project module) of each import at module level (``top_level``) or inside a function."""
    found = []
    nodes = (
        tree.body if top_level else [n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) for n in ast.walk(f)]
    )
    for node in nodes:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name in modules:
                found.append((node.lineno, name))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def main() -> int:
    files = module_files()
    names = set(files)
    graph: dict[str, set[str]] = {}
    problems = []
    for name, path in files.items():
        source = path.read_text()
        tree = ast.parse(source)
        deps = {m for _, m in imports(tree, names, top_level=True)} - {name}
        # importing a submodule runs its packages' __init__ first (the importer's own are running already)
        implicit = {p for d in deps for p in _parents(d) if p in names and p not in _parents(name) and p != name}
        graph[name] = deps | implicit
        lines = source.splitlines()
        for line, module in imports(tree, names, top_level=False):
            if "#" not in lines[line - 1]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: function-level import of {module} without a reason")
        if "lit_marl" in path.parts and len(lines) > 500:
            problems.append(f"{path.relative_to(ROOT)}: {len(lines)} lines (at most 500)")
        if "lit_marl" in path.parts:
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                    length = node.end_lineno - node.lineno + 1
                    problems.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} has {length} lines (at most 80)"
                    )
    for cycle in cycles(graph):
        problems.append("import circle: " + " -> ".join(cycle))
    print("\n".join(problems) or "layers: no import circle, no unexplained function-level import, sizes within bounds")
    return 1 if problems else 0


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


if __name__ == "__main__":
    sys.exit(main())
