"""Cooperative code generation: agents write functions of one program, tests decide the reward.

Roles are data: each writes one function (``defines``) from its own prompt template; the
program is the task's prelude (its imports and given helpers) + every role's code in order, and
the last role writes the entry point. ``single`` is one role; ``aux_main`` is CoMLRL's split
(agent 0 writes ``aux``, agent 1 the entry point, which may call it).

Level-based reward (each level is also reported as a metric, per turn):

1. definitions: the fraction of roles whose code defines their function; below 1 the reward
   stops here (``definitions`` weight times that fraction);
2. syntax: every role's code and the combined program parse; otherwise stop;
3. tests: the fraction of the task's tests passed, each test run on its own in the sandbox
   (``execution.py``); a program that cannot load passes none;
4. collaboration (two or more roles, and only once a test passes): the entry point calls a
   helper (+), is not a thin wrapper that only returns a helper's result (+), and does not call a
   helper and drop its result (-).

The reward is the weighted sum divided by the most a program can get, so 1.0 means every test
passed (and, with helpers, used well) in every role layout.
"""

from __future__ import annotations

import ast
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from lit_marl import ConfigError
from lit_marl.envs.base import TextEnv
from lit_marl.envs.code.canonical import expert_codes
from lit_marl.envs.code.execution import ExecReport, TestCase, TestLimits, run_tests, split_tests
from lit_marl.envs.code.expert import Expert
from lit_marl.envs.code.problems import load_problems
from lit_marl.envs.code.program import Analysis, extract_code, function_def, prelude, provided, syntax_error
from lit_marl.fields import PositiveInt, check_fields


@dataclass
class Role:
    """One agent's part of the program: the function it writes and its prompt template."""

    defines: str
    """The function this role writes; ``{entry_point}`` stands for the task's entry point."""
    prompt: str
    """Template over the task's fields (``{prompt}``, ``{entry_point}`` ...), ``{defines}`` and
    ``{helpers}`` (the functions the other roles write)."""
    name: str = ""
    """A label (``helper``, ``main``) shown with the agent in the expert's prompt and in error messages."""


SINGLE_PROMPT = (
    "Write a complete Python function `{defines}` that solves the task below. Reply with the code only, "
    "in one ```python block.\n\n{prompt}"
)
# the task comes first and the role last: small models otherwise write the task's own function
# (SmolLM2-135M: 0 of 3 defined aux with the role first, 4 of 8 this way)
AUX_PROMPT = (
    "Here is a coding task:\n\n{prompt}\nYour teammate will write `{entry_point}`. Your job is different: write "
    "a small helper function named `aux` that `{entry_point}` can call to do part of the work. Do not write "
    "`{entry_point}`. Reply with one ```python block that starts with `def aux(`."
)
MAIN_PROMPT = (
    "You and a teammate solve the task below together. Write a complete Python function `{defines}`. Your "
    "teammate writes a helper `aux(...)` that you can call; do not define `aux` yourself. Reply with the code "
    "only, in one ```python block.\n\n{prompt}"
)
LAYOUTS = {
    "single": [Role("{entry_point}", SINGLE_PROMPT, "main")],
    "aux_main": [Role("aux", AUX_PROMPT, "helper"), Role("{entry_point}", MAIN_PROMPT, "main")],
}
REVISE = "Revise your code and reply with the complete improved version only, in one ```python block."


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the reward levels; the reward is their weighted sum over the most a program can get."""

    definitions: float = 0.1
    """Times the fraction of roles whose code defines their function."""
    syntax: float = 0.1
    """Added when every function is defined and every role's code and the combined program parse."""
    tests: float = 0.6
    """Times the fraction of the task's tests passed (only once the syntax level is reached)."""
    calls_helper: float = 0.1
    """Added when the entry point calls a helper (two or more roles, and only once a test passes)."""
    not_wrapper: float = 0.1
    """Added when the entry point calls a helper and does more than return its result (as ``calls_helper``)."""
    ignored_result: float = -0.1
    """Added (a penalty) when the entry point calls a helper as a statement, dropping its result."""


class CodeEnv(TextEnv):
    """Cooperative code generation: each role writes one function of a program that the task's tests score,
    over one or more turns (plain revision, level feedback or an expert's edits)."""

    def __init__(
        self,
        roles: list[Role] | Literal["single", "aux_main"] = "single",
        transition: Literal["plain", "level_feedback", "expert_edits"] = "level_feedback",
        sandbox_slice: int | Literal["all"] | None = 1,
        include_original_prompt: bool = True,
        history: Literal["turns", "last", "all", "none"] | None = None,
        show_teammates: bool | None = None,
        revise_instruction: str = REVISE,
        weights: RewardWeights = RewardWeights(),
        test_limits: TestLimits = TestLimits(),
        expert: Expert | None = None,
        max_workers: PositiveInt | None = None,
    ):
        """
        Args:
            roles: ``single``, ``aux_main`` (CoMLRL's helper + main split) or a list of roles
                (``defines`` + ``prompt`` template each); the last role writes the entry point.
            transition: Next-turn prompts: ``plain`` (the agent's own history + revise instruction,
                CoMLRL's self-improvement mode), ``level_feedback`` (static checks and the results of
                the revealed tests) or ``expert_edits`` (the edits an expert model proposes to the
                agent's own function; needs ``expert``).
            sandbox_slice: Tests the feedback reveals: 1 (the first), n > 0 (first n), n < 0 (last |n|),
                0 / None / "all" (all). The reward always uses all tests.
            include_original_prompt: Repeat the agent's first prompt in later turns (``turns`` shows it
                anyway, as turn 1's prompt).
            history: The agent's own past shown: ``turns`` (every earlier turn's prompt and code, in
                order), the code of the ``last`` turn or of ``all`` turns, or ``none``. None: the
                mode's default, ``turns`` for ``plain`` (CoMLRL's plain mode), ``last`` otherwise.
            show_teammates: Also show the other roles' latest code (e.g. aux's signature to main).
                None: the mode's default, False for ``plain`` (CoMLRL shows an agent only its own
                turns), True otherwise.
            revise_instruction: The closing instruction of a later turn's prompt.
            weights: Weights of the reward levels.
            test_limits: Per-test timeout, per-program budget and memory of the sandboxed tests.
            expert: The expert model for ``expert_edits`` (a local model source, or an
                OpenAI-compatible endpoint).
            max_workers: Programs tested at once (default: twice the CPU count).
        """
        check_fields("data.env", CodeEnv.__init__, locals())
        self.roles = [
            Role(**r) if isinstance(r, dict) else r for r in (LAYOUTS[roles] if isinstance(roles, str) else roles)
        ]
        if not self.roles:
            raise ConfigError("data.env.roles: give at least one role")
        if self.roles[-1].defines != "{entry_point}":
            raise ConfigError(
                f"data.env.roles: the last role writes the entry point (defines: '{{entry_point}}'), "
                f"not {self.roles[-1].defines!r}"
            )
        if len({r.defines for r in self.roles}) != len(self.roles):
            raise ConfigError("data.env.roles: two roles define the same function")
        if transition == "expert_edits" and expert is None:
            raise ConfigError("data.env.transition=expert_edits needs data.env.expert (a model or an endpoint)")
        plain = transition == "plain"
        history = history or ("turns" if plain else "last")
        if history == "turns" and not include_original_prompt:
            raise ConfigError(
                "data.env.include_original_prompt=false cannot hold with data.env.history=turns"
                + (" (plain's default)" if plain else "")
                + ": turn 1's prompt is the original prompt; set data.env.history to last, all or none"
            )
        self.mode = transition
        self.sandbox_slice = sandbox_slice
        self.include_original_prompt = include_original_prompt
        self.history = history
        self.show_teammates = (not plain) if show_teammates is None else show_teammates
        self.revise_instruction = revise_instruction
        self.weights = weights
        self.test_limits = test_limits
        self.expert = expert
        self.max_workers = max_workers
        self._tests: dict[str, list[TestCase]] = {}
        self._reports: OrderedDict[tuple[str, str], ExecReport] = OrderedDict()  # the turn's runs, for feedback

    # ------------------------------------------------------------------ tasks and prompts
    @property
    def num_agents(self) -> int:
        return len(self.roles)

    def load_tasks(self, source: str, field: str) -> list[dict]:
        rows = load_problems(source, field)
        for role in self.roles:
            try:
                self._role_prompt(role, rows[0])
            except KeyError as err:
                raise ConfigError(
                    f"data.env.roles: the prompt of role {role.name or role.defines!r} uses the field {err} that "
                    f"the rows of {field}={source!r} lack; their fields are {sorted(rows[0])}"
                ) from None
        return rows

    def names(self, task: dict) -> list[str]:
        return [r.defines.format(entry_point=task["entry_point"]) for r in self.roles]

    def _role_prompt(self, role: Role, task: dict) -> str:
        names = self.names(task)
        own = role.defines.format(entry_point=task["entry_point"])
        helpers = ", ".join(n for n in names if n != own)
        return role.prompt.format(**{**task, "defines": own, "helpers": helpers})

    def prompts(self, task: dict) -> list[str]:
        return [self._role_prompt(role, task) for role in self.roles]

    def demonstration(self, task: dict) -> list[list[dict]]:
        """One expert chat per agent for supervised fine-tuning: its first prompt, then the code of the
        task's canonical solution (``demos.py``: the function itself for one role, split into the
        helper and the entry point for two) as the fenced reply this env parses. Replies leave out
        the helper functions the task's prompt gives (the program's prelude has them)."""
        if len(self.roles) > 2:
            raise NotImplementedError(
                f"demonstrations exist for one role or a helper + the entry point, not for the roles "
                f"{[r.name or r.defines for r in self.roles]}"
            )
        names = self.names(task)
        given = {s.name for s in ast.parse(prelude(task["prompt"], set(names))).body if isinstance(s, ast.FunctionDef)}
        return [
            [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": f"```python\n{extract_code(code, drop=given)}\n```"},
            ]
            for prompt, code in zip(self.prompts(task), expert_codes(task, names))
        ]

    # ------------------------------------------------------------------ analysis and tests
    def analyze(self, task: dict, completions: list[str]) -> Analysis:
        names = self.names(task)
        codes, redefined = [], []
        for i, text in enumerate(completions):
            others = set(names) - {names[i]}
            codes.append(extract_code(text, drop=others))
            redefined.append(sorted(others & {n for n in re.findall(r"def\s+(\w+)", text)}))
        program = "\n\n".join(p for p in [prelude(task["prompt"], set(names)), *codes] if p)
        errors = [syntax_error(code, f"the code of {names[i]}") for i, code in enumerate(codes)]
        errors.append("" if any(errors) else syntax_error(program, "the combined program"))
        # textual, so that a definition with a syntax error still counts for the first level
        defined = [bool(re.search(rf"^(async\s+)?def\s+{re.escape(n)}\s*\(", c, re.M)) for c, n in zip(codes, names)]
        out = Analysis(codes, names, program, defined, errors, redefined=redefined)
        main = function_def(codes[-1], names[-1])
        helpers = set(names[:-1])
        if main is not None and helpers:
            calls = [n for n in ast.walk(main) if isinstance(n, ast.Call) and getattr(n.func, "id", None) in helpers]
            out.calls_helper = bool(calls)
            body = [s for s in main.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            out.thin_wrapper = (
                len(body) == 1 and isinstance(body[0], ast.Return) and any(body[0].value is c for c in calls)
            )
            out.ignored_result = any(
                isinstance(s, ast.Expr) and any(s.value is c for c in calls) for s in ast.walk(main)
            )
        return out

    def tests_of(self, task: dict) -> list[TestCase]:
        key = task["task_id"] + task["test"]
        if key not in self._tests:
            self._tests[key] = split_tests(task["test"], task["entry_point"])
            if not self._tests[key]:
                raise ConfigError(f"task {task['task_id']!r}: its test has no assert that calls {task['entry_point']}")
        return self._tests[key]

    def run(self, tasks: list[dict], analyses: list[Analysis]) -> None:
        """Fill in the test reports of every analysis whose program parses: cached ones from this
        turn's reward, the rest in one parallel batch."""
        todo = []
        for task, a in zip(tasks, analyses):
            if not (all(a.defined) and a.syntax_ok):
                continue
            key = (task["task_id"], a.program)
            if key in self._reports:
                a.report = self._reports[key]
            else:
                todo.append((task, a, key))
        unique = {key: (task, a) for task, a, key in todo}
        jobs = [
            (a.program, self.tests_of(task), task["entry_point"], provided(task, a.names))
            for task, a in unique.values()
        ]
        for key, report in zip(unique, run_tests(jobs, self.test_limits, self.max_workers)):
            self._reports[key] = report
            while len(self._reports) > 8192:
                self._reports.popitem(last=False)
        for _, a, key in todo:
            a.report = self._reports[key]

    # ------------------------------------------------------------------ reward
    def reward(self, agent_completions: list[list[str]], tasks: list[dict]) -> dict[str, list[float]]:
        analyses = [self.analyze(task, [agent[j] for agent in agent_completions]) for j, task in enumerate(tasks)]
        self.run(tasks, analyses)
        w = self.weights
        collab = len(self.roles) > 1
        best = w.definitions + w.syntax + w.tests + (w.calls_helper + w.not_wrapper if collab else 0.0)
        out: dict[str, list[float]] = {
            key: []
            for key in ["reward", "success", "level/definitions", "level/syntax", "level/loaded", "level/tests_passed"]
            + (["collab/calls_helper", "collab/not_wrapper", "collab/ignored_result"] if collab else [])
        }
        for a in analyses:
            defs = sum(a.defined) / len(a.defined)
            syntax = float(defs == 1 and a.syntax_ok)
            passed = a.report.passed_frac if a.report else 0.0
            score = w.definitions * defs + syntax * (w.syntax + w.tests * passed)
            out["level/definitions"].append(defs)
            out["level/syntax"].append(syntax)
            out["level/loaded"].append(float(bool(a.report and a.report.loaded)))
            out["level/tests_passed"].append(passed)
            out["success"].append(float(passed == 1.0))
            if collab:
                active = passed > 0  # no bonus for calling a helper in a program that passes nothing
                bonus = [active and a.calls_helper, active and a.calls_helper and not a.thin_wrapper]
                penalty = active and a.ignored_result
                score += w.calls_helper * bonus[0] + w.not_wrapper * bonus[1] + w.ignored_result * penalty
                out["collab/calls_helper"].append(float(a.calls_helper))
                out["collab/not_wrapper"].append(float(a.calls_helper and not a.thin_wrapper))
                out["collab/ignored_result"].append(float(a.ignored_result))
            out["reward"].append(score / best)
        return out

    # ------------------------------------------------------------------ feedback and transitions
    def revealed(self, count: int) -> range:
        s = self.sandbox_slice
        if s in (0, None, "all"):
            return range(count)
        return range(min(s, count)) if s > 0 else range(max(count + s, 0), count)

    def feedback(self, task: dict, a: Analysis, agent: int) -> str:
        """Static checks, then the revealed tests' results; for the entry point the helper notes."""
        lines = []
        for name, ok in zip(a.names, a.defined):
            lines.append(f"- `{name}` is defined." if ok else f"- `{name}` is missing: define `def {name}(...)`.")
        if a.redefined[agent]:
            lines.append(f"- You also defined {', '.join(a.redefined[agent])}; your teammate's version is used.")
        errors = [e for e in a.syntax_errors if e]
        lines += [f"- {e}" for e in errors] or (["- The code parses."] if all(a.defined) else [])
        if a.report is not None:
            if not a.report.loaded:
                lines.append(f"- Running the program failed: {a.report.load_error}")
            tests = self.tests_of(task)
            shown = self.revealed(len(tests))
            for k in shown:
                outcome = a.report.outcomes[k]
                verdict = "passed" if outcome.passed else f"failed: {outcome.error} {outcome.message}".rstrip()
                lines.append(f"- Test `{tests[k].code}` {verdict}")
            lines.append(f"- {sum(a.report.outcomes[k].passed for k in shown)} of the {len(shown)} shown tests passed.")
        if agent == len(a.names) - 1 and len(a.names) > 1 and all(a.defined):
            helpers = ", ".join(f"`{n}`" for n in a.names[:-1])
            if not a.calls_helper:
                lines.append(f"- Your function does not call {helpers}.")
            elif a.thin_wrapper:
                lines.append(f"- Your function only returns {helpers}'s result: do part of the work yourself.")
            if a.ignored_result:
                lines.append(f"- Your function calls {helpers} but ignores the result.")
        return "\n".join(lines)

    def transition_metrics(self) -> dict[str, float]:
        """With ``expert_edits``: the fraction of branches whose expert reply stayed malformed after
        its retries (their roles got the fallback), and the format re-asks per branch."""
        return dict(getattr(self, "_transition_metrics", {}))

    def transition(
        self,
        *,
        task: list[dict],
        prompt: list[str],
        agent_completions: list[list[str]],
        num_agents: int,
        prompt_history_per_agent: list[list[list[str]]],
        response_history_per_agent: list[list[list[str]]],
    ) -> list[list[str]]:
        """Every branch's next prompt per agent: the agent's own past (``history``), its teammates'
        latest code (``show_teammates``), the mode's signal (none for ``plain``), the revise
        instruction. ``prompt`` (the task's prompt text) is not read: the task row has it, and the
        agent's own first prompt is the first entry of its prompt history."""
        analyses = [self.analyze(t, list(c)) for t, c in zip(task, agent_completions)]
        extra: list[list[str]] = [[""] * num_agents for _ in task]
        if self.mode == "level_feedback":
            self.run(task, analyses)
            extra = [
                ["Feedback on the team's program:\n" + self.feedback(t, a, i) for i in range(num_agents)]
                for t, a in zip(task, analyses)
            ]
        elif self.mode == "expert_edits":
            malformed, retries = self.expert.malformed_replies, self.expert.format_retries
            edits = self.expert.propose(
                [t["prompt"] for t in task], [a.program for a in analyses], [self.expert_roles(a) for a in analyses]
            )
            extra = [
                [
                    f"An expert reviewed the team's program and proposes these edits to your `{name}`:\n{e[name]}"
                    for name in a.names
                ]
                for a, e in zip(analyses, edits)
            ]
            self._transition_metrics = {  # per branch of this turn
                "expert_malformed_frac": (self.expert.malformed_replies - malformed) / max(len(task), 1),
                "expert_format_retries": (self.expert.format_retries - retries) / max(len(task), 1),
            }
        return [
            [
                self._next_prompt(a, i, prompt_history_per_agent[b][i], response_history_per_agent[b][i], extra[b][i])
                for i in range(num_agents)
            ]
            for b, a in enumerate(analyses)
        ]

    def expert_roles(self, a: Analysis) -> dict[str, str]:
        """Who writes each function of the program, for the expert's prompt (its reply is keyed by
        these functions, so each agent can be shown the edits to its own)."""
        roles = {}
        for i, (role, name) in enumerate(zip(self.roles, a.names)):
            who = f"agent {i + 1}" + (f" ({role.name})" if role.name else "")
            what = "the task's entry point" if i == len(a.names) - 1 else "a helper that the entry point can call"
            roles[name] = f"{who}, {what}"
        return roles

    def _next_prompt(self, a: Analysis, agent: int, prompts: list[str], responses: list[str], extra: str) -> str:
        others = set(a.names) - {a.names[agent]}

        def code(k: int) -> str:
            return f"Your code at turn {k + 1}:\n```python\n{extract_code(responses[k], drop=others)}\n```"

        parts = []
        if self.history == "turns":
            for k, turn_prompt in enumerate(prompts[: len(responses)]):
                parts += [f"Your prompt at turn {k + 1}:\n{turn_prompt}", code(k)]
        else:
            parts += [prompts[0]] if self.include_original_prompt else []
            shown = {"last": 1, "all": len(responses), "none": 0}[self.history]
            parts += [code(k) for k in range(max(len(responses) - shown, 0), len(responses))]
        if self.show_teammates and len(a.names) > 1:
            parts += [
                f"Your teammate's `{a.names[j]}`:\n```python\n{a.codes[j]}\n```"
                for j in range(len(a.names))
                if j != agent
            ]
        parts += [p for p in (extra, self.revise_instruction) if p]
        return "\n\n".join(parts)
