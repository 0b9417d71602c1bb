"""Synthesized regressions for the PyPI instance set (``pypi_set.py``), as text: AST-level mutation
operators that each make one minimal edit of one source line (so the fix is a small readable diff),
the removal of test functions from a test file (the tests an instance hides), and the problem
statement written from the failing behaviour.

Each operator looks at one AST node of a function body and proposes edits of single-line code:
``compare`` (``<`` / ``<=``, ``==`` / ``!=``, ``in`` / ``not in``, ``is`` / ``is not``), ``boolean``
(``and`` / ``or``), ``drop_not``, ``negate_if``, ``arithmetic`` (``+`` / ``-``, ``*`` / ``/``,
``//`` / ``/``, augmented assignments too), ``off_by_one`` (an int constant), ``bound`` (a slice bound
or the stop of ``range``), ``drop_statement`` (a call, an augmented assignment or an assignment to an
attribute or item, in a block that keeps another statement), ``swap_args``, ``true_false`` and
``swap_call`` (``min`` / ``max``, ``any`` / ``all``, ``startswith`` / ``endswith``, ...).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lit_marl.envs.swe.instances import apply_patch

Edit = tuple[int, int, int, str]
"""(line, start column, end column, new text): columns count characters of the line."""


def split_lines(text: str) -> list[str]:
    """The lines of ``text`` as Python numbers them (only ``\\n`` ends one), each with its newline."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


@dataclass(frozen=True)
class Mutation:
    path: str
    function: str
    """The qualified name of the function the edit is in (``Class.method``)."""
    line: int
    start: int
    end: int
    new: str
    operator: str

    def apply(self, text: str) -> str:
        lines = split_lines(text)
        old = lines[self.line - 1]
        lines[self.line - 1] = old[: self.start] + self.new + old[self.end :]
        return "".join(lines)

    def describe(self) -> str:
        return f"{self.operator} in {self.function} ({self.path}:{self.line})"


class _Source:
    def __init__(self, text: str):
        self.lines = split_lines(text)

    def _col(self, line: int, byte_col: int) -> int:
        return len(self.lines[line - 1].encode()[:byte_col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int, int] | None:
        """(line, start, end) of a node on one line; None for one that spans lines."""
        if node.lineno != node.end_lineno:
            return None
        return node.lineno, self._col(node.lineno, node.col_offset), self._col(node.lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> str | None:
        span = self.span(node)
        return self.lines[span[0] - 1][span[1] : span[2]] if span else None

    def token_between(self, a: ast.AST, b: ast.AST, token: str) -> tuple[int, int, int] | None:
        """Where ``token`` is between nodes ``a`` and ``b`` of one line (only brackets and spaces beside it)."""
        first, second = self.span(a), self.span(b)
        if not first or not second or first[0] != second[0]:
            return None
        gap = self.lines[first[0] - 1][first[2] : second[1]]
        found = re.fullmatch(r"[\s()]*(" + r"\s+".join(map(re.escape, token.split())) + r")[\s()]*", gap)
        return (first[0], first[2] + found.start(1), first[2] + found.end(1)) if found else None


_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
_CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="),
        ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"),
        ast.IsNot: ("is not", "is")}  # fmt: skip
_BIN = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"), ast.FloorDiv: ("//", "/"),
        ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"), ast.BitOr: ("|", "&"),
        ast.BitAnd: ("&", "|"), ast.BitXor: ("^", "|"), ast.Pow: ("**", "*")}  # fmt: skip
_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
_METHODS = {"startswith": "endswith", "endswith": "startswith", "lstrip": "rstrip", "rstrip": "lstrip",
            "lower": "upper", "upper": "lower", "find": "rfind", "rfind": "find", "split": "rsplit",
            "rsplit": "split", "isupper": "islower", "islower": "isupper"}  # fmt: skip


def _wrap(node: ast.AST, text: str) -> str:
    return text if isinstance(node, _ATOMS) else f"({text})"


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr | ast.List | ast.Tuple) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
    )


def op_compare(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.Compare):
        for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
            old, new = _CMP[type(op)]
            where = src.token_between(left, right, old)
            if where:
                yield (*where, new)


def op_boolean(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.BoolOp):
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        where = src.token_between(node.values[0], node.values[1], old)
        if where:
            yield (*where, new)


def op_drop_not(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        span, inner = src.span(node), src.span(node.operand)
        if span and inner and span[0] == inner[0]:
            found = re.match(r"not\s*", src.lines[span[0] - 1][span[1] : inner[1]])
            if found:
                yield span[0], span[1], span[1] + found.end(), ""


def op_negate_if(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.If | ast.While) and not isinstance(node.test, ast.UnaryOp):
        span, text = src.span(node.test), src.text(node.test)
        if span:
            yield (*span, "not " + _wrap(node.test, text))


def op_arithmetic(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN and not (_is_text(node.left) or _is_text(node.right)):
        old, new = _BIN[type(node.op)]
        where = src.token_between(node.left, node.right, old)
        if where:
            yield (*where, new)
    if isinstance(node, ast.AugAssign) and type(node.op) in _BIN and not _is_text(node.value):
        old, new = _BIN[type(node.op)]
        where = src.token_between(node.target, node.value, old + "=")
        if where:
            yield (*where, new + "=")


def op_off_by_one(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.Constant) and type(node.value) is int and re.fullmatch(r"\d+", src.text(node) or ""):
        span = src.span(node)
        yield (*span, str(node.value + 1))
        if node.value > 0:
            yield (*span, str(node.value - 1))


def op_bound(node: ast.AST, src: _Source) -> Iterator[Edit]:
    bounds = []
    if isinstance(node, ast.Slice):
        bounds = [(node.lower, " + 1"), (node.upper, " - 1")]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" and node.args:
        bounds = [(node.args[min(1, len(node.args) - 1)], " + 1")]
    for bound, delta in bounds:
        if bound is not None and not isinstance(bound, ast.Constant) and src.span(bound):
            yield (*src.span(bound), _wrap(bound, src.text(bound)) + delta)


def op_drop_statement(node: ast.AST, src: _Source) -> Iterator[Edit]:
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if not isinstance(block, list) or len(block) < 2:
            continue
        for stmt in block:
            droppable = (
                (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call | ast.Yield | ast.YieldFrom))
                or isinstance(stmt, ast.AugAssign)
                or (
                    isinstance(stmt, ast.Assign)
                    and all(isinstance(t, ast.Attribute | ast.Subscript) for t in stmt.targets)
                )
            )
            span = src.span(stmt) if droppable else None
            if span:
                line = src.lines[span[0] - 1]
                if not line[: span[1]].strip() and re.fullmatch(r"\s*(#.*)?\n?", line[span[2] :]):
                    yield span[0], 0, len(line), ""


def op_swap_args(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args):
        first, second = src.span(node.args[0]), src.span(node.args[1])
        if first and second and first[0] == second[0]:
            a, b = src.text(node.args[0]), src.text(node.args[1])
            gap = src.lines[first[0] - 1][first[2] : second[1]]
            if a != b and re.fullmatch(r"\s*,\s*", gap):
                yield first[0], first[1], second[2], b + gap + a


def op_true_false(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if isinstance(node, ast.Constant) and node.value in (True, False) and type(node.value) is bool and src.span(node):
        yield (*src.span(node), str(not node.value))


def op_swap_call(node: ast.AST, src: _Source) -> Iterator[Edit]:
    if not isinstance(node, ast.Call):
        return
    func, span = node.func, src.span(node.func)
    if span and isinstance(func, ast.Name) and func.id in _NAMES:
        yield (*span, _NAMES[func.id])
    elif span and isinstance(func, ast.Attribute) and func.attr in _METHODS and src.text(func).endswith(func.attr):
        yield span[0], span[2] - len(func.attr), span[2], _METHODS[func.attr]


OPERATORS: dict[str, Callable[[ast.AST, _Source], Iterator[Edit]]] = {
    "compare": op_compare, "boolean": op_boolean, "drop_not": op_drop_not, "negate_if": op_negate_if,
    "arithmetic": op_arithmetic, "off_by_one": op_off_by_one, "bound": op_bound,
    "drop_statement": op_drop_statement, "swap_args": op_swap_args, "true_false": op_true_false,
    "swap_call": op_swap_call,
}  # fmt: skip


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method of a module, with its qualified name, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif not isinstance(node, ast.expr):
            yield from functions(node, prefix)


def _body_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The function node and the nodes of its body; not nested functions or classes (their own), not
    f-strings (their positions are unreliable)."""
    yield function
    stack = list(reversed(function.body))
    while stack:
        node = stack.pop()
        yield node
        stack += reversed(
            [
                c
                for c in ast.iter_child_nodes(node)
                if not isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.JoinedStr)
            ]
        )


def parses(mutation: Mutation, text: str) -> bool:
    try:
        ast.parse(mutation.apply(text))
    except SyntaxError:
        return False
    return True


def mutations(
    text: str, path: str, operators: list[str] | None = None, lines: set[int] | None = None, check: bool = True
) -> list[Mutation]:
    """Every mutation of ``text`` (the file ``path``) by ``operators`` (default: all) on ``lines``
    (default: all) that changes the code and (``check``: parsing the whole file each time) still
    parses; in source order, each edit once."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    src, found, seen = _Source(text), [], set()
    for name, function in functions(tree):
        for node in _body_nodes(function):
            for operator in operators or OPERATORS:
                for line, start, end, new in OPERATORS[operator](node, src):
                    if lines is not None and line not in lines:
                        continue
                    mutation = Mutation(path, name, line, start, end, new, operator)
                    edited = src.lines[line - 1][:start] + new + src.lines[line - 1][end:]
                    if (
                        edited == src.lines[line - 1]
                        or (line, edited) in seen
                        or (check and not parses(mutation, text))
                    ):
                        continue
                    seen.add((line, edited))
                    found.append(mutation)
    return sorted(found, key=lambda m: (m.line, m.start, m.operator, m.new))


def make_patch(before: dict[str, str], after: dict[str, str], what: str) -> str:
    """A git-style diff from ``before`` to ``after`` (the same files) that ``instances.apply_patch``
    turns back into ``after`` exactly: more context where a hunk would also fit at an earlier place."""
    for context in (3, 6, 12, 40):
        patch = ""
        for path in sorted(after):
            if before[path] != after[path]:
                lines = difflib.unified_diff(
                    split_lines(before[path]), split_lines(after[path]), f"a/{path}", f"b/{path}", n=context
                )
                body = "".join(
                    line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
                )
                patch += f"diff --git a/{path} b/{path}\n" + body
        try:
            got = apply_patch({p: t.encode() for p, t in before.items()}, patch, what)
        except ValueError:
            continue
        if all(got[p] == after[p].encode() for p in after):
            return patch
    raise ValueError(f"{what}: no diff of {sorted(after)} applies back exactly")


# --------------------------------------------------------------------------- hiding tests
def test_node(tree: ast.Module, name: str) -> list[ast.AST]:
    """The chain of class and function nodes of a test name (``Class::test_m``); ValueError if absent."""
    body, chain = tree.body, []
    for part in name.split("::"):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
            ),
            None,
        )
        if node is None:
            raise ValueError(f"no test {name!r} defined in the file (inherited or generated)")
        chain.append(node)
        body = getattr(node, "body", [])
    return chain


def remove_tests(text: str, names: list[str]) -> str:
    """``text`` without the test functions or methods ``names`` (``test_x``, ``Class::test_m``, no
    parameters), decorators and the blank lines before them included; a class left without a
    statement goes as a whole. ValueError when a test is not defined in the file itself."""
    tree, lines = ast.parse(text), split_lines(text)
    chains = [test_node(tree, name) for name in dict.fromkeys(names)]
    drop: set[int] = set()

    def cut(node: ast.AST) -> None:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        while first > 1 and not lines[first - 2].strip():
            first -= 1
        drop.update(range(first, node.end_lineno + 1))

    for chain in chains:
        cut(chain[-1])
    for chain in sorted(chains, key=len, reverse=True):  # inner classes first
        for node in reversed(chain[:-1]):
            if all(set(range(s.lineno, s.end_lineno + 1)) <= drop for s in node.body):
                cut(node)
    out = "".join(line for i, line in enumerate(lines, 1) if i not in drop)
    ast.parse(out)
    return out


# --------------------------------------------------------------------------- problem statements
def symptom(message: str) -> str:
    """What a failing test's crash line says happened, without the values it compared."""
    raised = re.search(r"DID NOT RAISE <class '([\w.]+)'>", message)
    if raised:
        return f"no longer raises `{raised.group(1).rsplit('.', 1)[-1]}` for input it must reject"
    if "DID NOT WARN" in message:
        return "no longer warns where it should"
    if message.startswith(("assert", "AssertionError", "Failed")) or not message:  # Failed: pytest.fail()
        return "gives wrong results"
    kind = re.match(r"([A-Za-z_][\w.]*)(:|$)", message)
    if kind and kind.group(1).rsplit(".", 1)[-1][:1].isupper():
        return f"raises `{kind.group(1).rsplit('.', 1)[-1]}`"
    return "misbehaves"


def _topic(test: str) -> str:
    parts = test.split("[", 1)[0].split("::")[1:]
    words = [re.sub(r"^(test_?|Test)", "", p).replace("_", " ").strip() for p in parts]
    return " / ".join(w for w in words if w) or parts[-1]


def problem_statement(project: str, version: str, subjects: list[str], messages: dict[str, str]) -> str:
    """A bug report from the failing behaviour: ``subjects`` name what misbehaves (``pkg.func()``),
    ``messages`` hold each failing test's crash line (only its kind is told, never the values).
    Template-chosen by a hash, so the same instance always reads the same."""
    symptoms = sorted({symptom(m) for m in messages.values()})[:2]
    topics = sorted({_topic(t) for t in messages})[:3]
    subject, what = " and ".join(dict.fromkeys(subjects)), " and ".join(symptoms)
    seen = ", ".join(f"'{t}'" for t in topics)
    count = "1 test fails" if len(messages) == 1 else f"{len(messages)} tests fail"
    pick = int(hashlib.sha256(repr((project, subjects, sorted(messages))).encode()).hexdigest(), 16) % 3
    if pick == 0:
        return (
            f"{project} {version}: {subject} {what}.\n\nSince a recent change, {subject} {what}. The "
            f"behaviour the project's tests describe as {seen} is affected ({count}). "
            "Please restore the documented behaviour without breaking anything else."
        )
    if pick == 1:
        return (
            f"Regression in {subject}\n\nUsing {project} {version}, {subject} {what}; it used to work. "
            f"Cases that show it: {seen}. Fix the regression; the rest of the test suite must keep passing."
        )
    return (
        f"Bug: {subject} {what}\n\nAfter the last change to {project} ({version}), {subject} {what}. "
        f"This breaks the scenarios {seen} ({count}). Find the cause and fix it."
    )
