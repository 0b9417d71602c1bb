"""Tasks answered with tools (``data.env: tools``): each turn the agent either calls tools - their
results come back as tool messages in its own chat format - or answers; a reply without a call is
the answer, and the reward function scores it with every call the episode made.

A task row holds the prompt (``prompt_field``), whatever the reward reads (``{"prompt": "What is
37 * 91?", "answer": 3367}``) and, to be demonstrated, an ``expert`` (its calls and its answer).
``reward`` is a function (or ``module:function``) called as ``fn(task=..., answer=...,
calls=[{"name", "arguments", "result", "error"}, ...])`` returning a score in [0, 1] (1: solved).
Counted per episode (``env/`` metrics): ``calls``, ``malformed`` (calls that did not parse: the
agent read why), ``tool_errors`` (calls that failed: no such tool, wrong arguments, an exception,
a timeout)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

from lit_marl.envs.base import register
from lit_marl.envs.game import Game, StepResult
from lit_marl.tasks import import_object
from lit_marl.tools.calls import ToolResults, failed, run_calls
from lit_marl.tools.formats import ToolCall, format_calls, read_text
from lit_marl.tools.spec import load_tools


@register("tools")
class ToolTask(Game):
    """A task answered with tools: calls until a reply without one, which the reward function scores."""

    num_agents = 1
    cloneable = True

    def __init__(
        self,
        tools: list[Callable | str],
        reward: Callable | str,
        parser: str = "auto",
        max_calls_per_turn: int = 4,
        call_timeout_s: float = 10.0,
        prompt_field: str = "prompt",
    ):
        """
        Args:
            tools: The tools, each a function (or its ``module:function`` path) whose type hints and Google-style
                docstring make its JSON schema (``lit_marl.tools.spec``).
            reward: The function (or its ``module:function`` path) scoring the answer: ``fn(task=, answer=,
                calls=)`` -> a score in [0, 1].
            parser: How replies are read: ``auto`` (the tokenizer's response template, else the format its
                chat template names, else Hermes's in a system message), ``template``, ``hermes``,
                ``llama3_json`` or ``mistral``.
            max_calls_per_turn: Calls run per reply, in order; the rest are answered as not run.
            call_timeout_s: Time limit of one call.
            prompt_field: The task row's field that is the first user message.
        """
        self.tools = tuple(load_tools(tools, "data.env_kwargs.tools"))
        self.reward_fn = import_object(reward, "data.env_kwargs.reward") if isinstance(reward, str) else reward
        self.tool_parser, self.max_calls, self.timeout_s = parser, max_calls_per_turn, call_timeout_s
        self.prompt_field = prompt_field

    def start(self, task: dict) -> list[str]:
        self.task, self.calls = task, []
        self.counts = {"calls": 0.0, "malformed": 0.0, "tool_errors": 0.0}
        return [str(task[self.prompt_field])]

    def act(self, actions: list) -> StepResult:
        reply = read_text(actions[0], self.tool_parser)
        if not (reply.calls or reply.errors):
            score = float(self.reward_fn(task=self.task, answer=reply.content, calls=list(self.calls)))
            return StepResult([""], terminated=True, info=self._info(score, ended=True))
        malformed = [failed(error) for error in reply.errors]
        results = malformed + run_calls(reply.calls, self.tools, self.timeout_s, self.max_calls)
        for result in results[len(malformed) :]:
            self.calls.append(result.record())
        self.counts["calls"] += len(reply.calls)
        self.counts["malformed"] += len(reply.errors)
        self.counts["tool_errors"] += sum(r.error for r in results[len(malformed) :])
        return StepResult([ToolResults(tuple(results))], info=self._info(0.0, ended=False))

    def expert_turns(self, task: dict) -> list[list[str]]:
        """A task with an ``expert`` field (``{"calls": [{"name", "arguments"}, ...], "answer": text}``):
        its calls in one reply, written in the format this game reads (Hermes's where ``parser`` is
        ``auto``), then its answer."""
        expert = task.get("expert")
        if not isinstance(expert, dict):
            raise NotImplementedError("a tool task demonstrates only with an 'expert' field: {calls, answer}")
        calls = [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in expert.get("calls", [])]
        written = format_calls(calls, self.tool_parser)
        return [*([[written]] if calls else []), [str(expert["answer"])]]

    def _info(self, score: float, ended: bool) -> dict:
        won = ended and score >= 1.0
        return {"won": won, "lost": ended and not won, "score": score, "max_score": 1.0, "counts": dict(self.counts)}


# --------------------------------------------------------------------------- a calculator task
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _value(node: ast.AST) -> float:
    """An arithmetic expression's value: numbers and + - * / // % ** only (exponents up to 64), never Python."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "37 * 91".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _value(ast.parse(expression, mode="eval").body)
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def number_answer(task: dict, answer: str, calls: list[dict]) -> float:
    """1 when the answer's last number is the task's ``answer``, else 0."""
    numbers = [token for token in answer.replace(",", "").split() if _is_number(token.strip(".!?"))]
    return float(bool(numbers) and float(numbers[-1].strip(".!?")) == float(task["answer"]))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
