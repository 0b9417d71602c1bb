"""The program a team writes: each role's code out of its reply, the task's prelude and provided
helpers, and the analysis the level-based reward and the feedback read (which functions are
defined, whether every piece parses)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from lit_marl.envs.code.execution import ExecReport, _warn_once

_FENCE = re.compile(r"```[\w+-]*[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)
_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def extract_code(text: str, drop: set[str] = frozenset()) -> str:
    """The code of a reply: its (first function-bearing) fenced block, else the whole text, keeping
    only imports, definitions and assignments (no demo prints or tests at the top level) and no
    definition of a name in ``drop`` (another role's function). Unparseable code is kept as is so
    that the syntax level sees it."""
    blocks = _FENCE.findall(text)
    code = next((b for b in blocks if "def " in b), blocks[0] if blocks else text)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code.strip("\n")
    keep = [
        s
        for s in tree.body
        if isinstance(s, _KEEP) and not (isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name in drop)
    ]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def prelude(task_prompt: str, skip: set[str]) -> str:
    """What the task gives every program: the prompt's imports and its complete helper functions
    (e.g. HumanEval's ``poly``), without the stub of the functions the roles write."""
    try:
        tree = ast.parse(task_prompt)
    except SyntaxError:  # a prose prompt (MBPP): no code to give
        return ""
    keep = [
        s
        for s in tree.body
        if isinstance(s, (ast.Import, ast.ImportFrom))
        or (isinstance(s, (ast.FunctionDef, ast.ClassDef)) and s.name not in skip)
    ]
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


def _check_names(test_source: str, name: str) -> bool:
    """Whether a HumanEval-style ``check`` uses ``name`` itself (not through its parameter)."""
    try:
        tree = ast.parse(test_source)
    except SyntaxError:
        return False
    check = next((s for s in tree.body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    return check is not None and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(check))


def provided(task: dict, names: list[str]) -> str:
    """The task's own code the tests may call besides the program's entry point (``run_tests``
    runs it in the tests' namespace, which sees nothing else of the program): the prompt's imports
    and helpers (HumanEval/32's ``poly``, 38's ``encode_cyclic``), as the task defines them. Where a
    HumanEval-style ``check`` names the entry point itself (HumanEval/33 compares
    ``candidate(x)`` with ``sort_third(x)``), that name is the task's reference solution, so that
    such an assert compares the candidate with the reference instead of with itself."""
    entry, reference = task["entry_point"], task.get("canonical_solution") or ""
    if _check_names(task["test"], entry):
        try:
            with_reference = prelude(task["prompt"] + reference, set(names) - {entry})
            if reference and any(
                isinstance(s, ast.FunctionDef) and s.name == entry for s in ast.parse(with_reference).body
            ):
                return with_reference
        except SyntaxError:
            pass
        _warn_once(
            f"task {task.get('task_id', '')!r}: its check names {entry} itself but the task has no reference "
            "solution (canonical_solution): those asserts compare the program with itself"
        )
    return prelude(task["prompt"], set(names))


def function_def(code: str, name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    return next(
        (s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name), None
    )


@dataclass
class Analysis:
    """Everything known about one joint action's program; the reward and the feedback read it."""

    codes: list[str]
    names: list[str]
    program: str
    defined: list[bool]
    syntax_errors: list[str]  # per role ("" when it parses), then the combined program's
    calls_helper: bool = False
    thin_wrapper: bool = False
    ignored_result: bool = False
    report: ExecReport | None = None
    redefined: list[list[str]] = field(default_factory=list)  # per role: other roles' functions it wrote

    @property
    def syntax_ok(self) -> bool:
        return not any(self.syntax_errors)


def syntax_error(code: str, what: str) -> str:
    try:
        ast.parse(code)
    except SyntaxError as err:
        return f"SyntaxError in {what} at line {err.lineno}, column {err.offset}: {err.msg}"
    return ""
