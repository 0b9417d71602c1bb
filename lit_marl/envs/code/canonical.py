"""Expert demonstrations of the code environment, made from each task's canonical solution.

With one role the demonstration is the canonical function itself. With a helper and the entry
point (``aux_main``) the canonical function is split in two: its largest sub-expression worth a
function becomes ``def aux(<the local names it reads>): return <expression>`` and the entry point
calls ``aux`` in its place. The entry point then calls the helper, uses its result and still does
part of the work, so the pair earns every collaboration level of the reward, and the program
computes what the canonical one computes. ``scripts/make_demos.py`` scores them all with the
env's own reward and keeps only those at full marks: a split that changed a result, or a
canonical solution that fails its own tests, never becomes fine-tuning data.
"""

from __future__ import annotations

import ast
import copy
import re

_UNMOVABLE = (ast.Yield, ast.YieldFrom, ast.Await, ast.NamedExpr)
"""Expressions that mean something else, or nothing, once moved into another function."""
_SCOPE_SENSITIVE = {"locals", "vars", "eval", "exec", "super"}
"""Builtins that read the calling frame: inside ``aux`` they would see aux's."""


def solution_module(prompt: str, canonical_solution: str, entry_point: str) -> ast.Module | None:
    """The complete canonical program: HumanEval's prompt + the body that completes it, or (MBPP,
    whose prompt is prose) the solution alone; None when neither parses and defines the entry point."""
    for source in (prompt + canonical_solution, canonical_solution):
        try:
            module = ast.parse(source)
        except SyntaxError:
            continue
        if _entry(module, entry_point) is not None:
            return module
    return None


def _entry(module: ast.Module, entry_point: str) -> ast.FunctionDef | None:
    return next((s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == entry_point), None)


def _free_names(node: ast.AST) -> dict[str, None]:
    """The names an expression reads from its surroundings, in order (an ordered set): not those
    that its own comprehensions and lambdas bind."""
    if isinstance(node, ast.Name):
        return {node.id: None} if isinstance(node.ctx, ast.Load) else {}
    if isinstance(node, ast.Lambda):
        a = node.args
        bound = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
        out = {}
        for default in [*a.defaults, *filter(None, a.kw_defaults)]:
            out |= _free_names(default)
        return out | {n: None for n in _free_names(node.body) if n not in bound}
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        gens = node.generators
        bound = {n.id for g in gens for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = [*(g.iter for g in gens[1:]), *(c for g in gens for c in g.ifs)]
        inner += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        out = _free_names(gens[0].iter)  # the first iterable is evaluated outside the comprehension
        for part in inner:
            out |= {n: None for n in _free_names(part) if n not in bound}
        return out
    out = {}
    for child in ast.iter_child_nodes(node):
        out |= _free_names(child)
    return out


def _bound_names(fn: ast.FunctionDef) -> set[str]:
    """Every name that ``fn`` binds somewhere other than by an import: parameters, assignment and
    loop targets, nested definitions and their parameters, comprehension targets."""
    names = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not fn:
            names.add(n.name)
        elif isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name:
            names.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            names.add(n.rest)
    return names


def _imports(statements: list[ast.AST]) -> dict[str, ast.stmt]:
    """For each name an import among ``statements`` (or inside them) binds: an import of that name alone."""
    out = {}
    for stmt in statements:
        for n in ast.walk(stmt):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for alias in n.names:
                    if alias.name != "*":
                        name = alias.asname or alias.name.split(".")[0]
                        out[name] = (
                            ast.Import([alias])
                            if isinstance(n, ast.Import)
                            else ast.ImportFrom(n.module, [alias], n.level)
                        )
    return out


def _trivial(node: ast.expr) -> bool:
    """A name, a constant, an attribute of a name, or a value without names (``-1``, ``[]``): a
    function returning it would be a renamed variable."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, (ast.Name, ast.Constant)) or not any(isinstance(n, ast.Name) for n in ast.walk(node))


def _movable(node: ast.expr) -> bool:
    if isinstance(node, (ast.Slice, ast.Starred, ast.FormattedValue, ast.Lambda)):
        return False  # not values of their own, or (lambda) better split inside
    if not isinstance(getattr(node, "ctx", ast.Load()), ast.Load) or _trivial(node):
        return False
    return not any(
        isinstance(n, _UNMOVABLE) or (isinstance(n, ast.Name) and n.id in _SCOPE_SENSITIVE) for n in ast.walk(node)
    )


def _candidates(fn: ast.FunctionDef) -> list[ast.expr]:
    """The sub-expressions of ``fn``'s body that can become a helper, largest first. Not a whole
    returned value (``fn`` would be a thin wrapper), not a statement's whole value (its result
    would be dropped), not a called function itself (``aux(x)(y)``), nothing in annotations or
    match patterns."""
    skip = {id(s.value) for s in ast.walk(fn) if isinstance(s, (ast.Return, ast.Expr)) and s.value is not None}
    skip |= {id(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.expr) and id(node) not in skip and _movable(node):
            found.append(node)
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "format_spec", "pattern"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child)

    for stmt in fn.body:  # not the defaults or decorators: they run before aux exists
        visit(stmt)
    return sorted(found, key=lambda n: -sum(1 for _ in ast.walk(n)))


def _replaced(module: ast.Module, target: ast.expr, call: ast.expr) -> ast.Module:
    """A copy of ``module`` with its node ``target`` replaced by ``call``."""
    memo: dict[int, object] = {}
    out = copy.deepcopy(module, memo)
    twin = memo[id(target)]  # deepcopy's memo maps each original's id to its copy

    class Swap(ast.NodeTransformer):
        def visit(self, node: ast.AST) -> ast.AST:
            return call if node is twin else self.generic_visit(node)

    return Swap().visit(out)


def _compiles(code: str) -> bool:
    try:
        compile(code, "<demonstration>", "exec")
    except SyntaxError:
        return False
    return True


def split_solution(
    prompt: str, canonical_solution: str, entry_point: str, helper: str = "aux"
) -> tuple[str, str] | None:
    """The canonical program split into ``(helper code, main code)``, or None when it has no
    sub-expression that can move (or already uses the name ``helper``).

    The helper returns the largest movable sub-expression of the entry point; its parameters are
    the names the expression reads that the entry point binds (parameters, locals, nested
    functions, enclosing comprehension targets), in order of use, and the main code calls it
    with the same names in the expression's place. Names imported by the program that it reads are
    imported by the helper code; other globals and builtins stay free. The main code is the
    whole program (imports, given helpers, the entry point with its signature and docstring)."""
    module = solution_module(prompt, canonical_solution, entry_point)
    if module is None:
        return None
    if re.search(rf"\b{re.escape(helper)}\b", ast.unparse(module)):
        return None  # the program already has something of that name
    fn = _entry(module, entry_point)
    bound = _bound_names(fn)
    imports = _imports([*(s for s in module.body if isinstance(s, (ast.Import, ast.ImportFrom))), fn])
    for expr in _candidates(fn):
        names = _free_names(expr)
        params = [n for n in names if n in bound]
        header = [ast.unparse(imports[n]) for n in names if n not in bound and n in imports]
        aux = "\n".join([*header, f"def {helper}({', '.join(params)}):\n    return {ast.unparse(expr)}"])
        call = ast.Call(ast.Name(helper, ast.Load()), [ast.Name(p, ast.Load()) for p in params], [])
        main = ast.unparse(_replaced(module, expr, call))
        if _compiles(aux) and _compiles(main):
            return ast.unparse(ast.parse(aux)), main
    return None


def expert_codes(task: dict, names: list[str]) -> list[str]:
    """Each role's code for ``task`` (roles defining ``names``: the entry point alone, or a helper
    and the entry point): the canonical program, or its split. A ValueError names the task when
    it has no usable canonical solution or no split."""
    task_id = task.get("task_id", "(no task_id)")
    if not task.get("canonical_solution", "").strip():
        raise ValueError(f"task {task_id!r} has no canonical_solution to demonstrate")
    module = solution_module(task["prompt"], task["canonical_solution"], task["entry_point"])
    if module is None:
        raise ValueError(
            f"task {task_id!r}: neither prompt + canonical_solution nor canonical_solution alone parses and "
            f"defines {task['entry_point']}"
        )
    if len(names) == 1:
        return [ast.unparse(module)]
    split = split_solution(task["prompt"], task["canonical_solution"], task["entry_point"], helper=names[0])
    if split is None:
        raise ValueError(f"task {task_id!r}: no sub-expression of its canonical solution can become `{names[0]}`")
    return list(split)
