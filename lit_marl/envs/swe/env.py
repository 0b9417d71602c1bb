"""SWE-Gym-style repositories as a stateful ``Env``: fix a repository with tools over many turns,
rewarded by its tests.

A task row is an instance in SWE-Gym's schema (``instances.py``). ``reset`` makes a fresh copy of
the repository at ``base_commit`` (``workspace.py``) and shows the problem, the files, the tests
that must pass and the tools (``HELP``). Each turn the agent's reply is one tool call; a
malformed one gets an error observation and the episode goes on. ``submit``, the env's own turn
limit (``max_steps``) or its output budget end the episode; so does the rollout's turn or context
budget (``finish``). Then the changes are scored on a fresh copy (``scoring.py``) and the workspace
is removed. ``info``: ``won`` = resolved (every listed test passes), ``score`` = the fraction of
listed tests passed (``reward: fraction``) or 1/0 (``reward: resolved``), ``max_score`` 1; the
reward is ``won + score_weight x score`` (the game's ``RewardRule``). ``expert_turns`` are
the known fix (``patch``) as tool calls, then ``submit``.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Literal

from lit_marl import ConfigError
from lit_marl.envs.base import register
from lit_marl.envs.game import Game, StepResult
from lit_marl.envs.swe.instances import normalize, parse_patch, resolve_source, snapshot
from lit_marl.envs.swe.scoring import SITE, Score, TestSettings, changed_lines, run_tests, score
from lit_marl.envs.swe.tool_mode import SWE_TOOLS, TOOLS_HELP, arguments_of, from_text_call
from lit_marl.envs.swe.tools import (
    FILE_TOOLS,
    HELP,
    ToolCall,
    ToolError,
    as_calls,
    create_text,
    insert_text,
    parse,
    replace_text,
    search_text,
)
from lit_marl.envs.swe.tools_site import tools_site
from lit_marl.envs.swe.workspace import Workspace, default_root, sweep
from lit_marl.fields import NonNegativeInt, PositiveFloat, PositiveInt, check_fields
from lit_marl.sandbox import Limits, run_in
from lit_marl.tools.calls import ToolResult, ToolResults, failed
from lit_marl.tools.formats import ParserName, format_calls, read_text

_swept: set[str] = set()
_sweep_lock = threading.Lock()


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (its head and tail) with a marker saying how much went."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}"


def file_list(names: list[str], limit: int) -> str:
    """The file names, comma-separated, as many as fit in ``limit`` characters (at most 80), then a
    marker saying how many more there are."""
    shown, size = [], 0
    for name in names[:80]:
        if size + len(name) + 2 > limit - 40:
            break
        shown.append(name)
        size += len(name) + 2
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f" [... and {rest} more files: `run ls -R` lists them]" if rest else "")


@register("swe")
class SWEEnv(Game):
    """Fix a repository (a SWE-Gym instance) with tool calls over many turns; its tests score the changes."""

    task_sets = ("swe",)
    resolve_set = staticmethod(resolve_source)

    num_agents = 1
    cloneable = True

    def __init__(
        self,
        repos_dir: str | None = None,
        reward: Literal["fraction", "resolved"] = "fraction",
        max_steps: PositiveInt = 12,
        max_observation_chars: PositiveInt = 2000,
        max_output_chars: PositiveInt = 20_000,
        command_timeout_s: PositiveFloat = 20.0,
        workspace_mb: PositiveInt = 64,
        list_tests: bool = True,
        expert_view_context: NonNegativeInt | None = None,
        workspace_root: str | None = None,
        tests: TestSettings | dict | None = None,
        command_limits: dict | None = None,
        tool_mode: Literal["text", "tools"] = "text",
        tool_parser: ParserName = "auto",
    ):
        """
        Args:
            repos_dir: Folder of local repository copies (``owner__name`` or ``owner/name``), for rows
                without ``repo_path``.
            reward: ``fraction``: ``score`` is the fraction of listed tests passed; ``resolved``: 1
                when every listed test passes, else 0. ``won`` is resolved either way.
            max_steps: Tool calls per episode; the last one is followed by scoring.
            max_observation_chars: Characters of one observation (a tool's output is cut, marked).
            max_output_chars: Characters of all observations of an episode; past it the episode ends
                (scored).
            command_timeout_s: Wall seconds of one ``run`` command.
            workspace_mb: Size of the workspace past which a ``run`` ends the episode (scored).
            list_tests: Name the PASS_TO_PASS tests, and how many FAIL_TO_PASS tests are hidden, in
                the first observation.
            expert_view_context: The known fix as demonstrations (``expert_turns``) first views each hunk's
                lines with this many around them, then replaces them (look, then edit); None: it edits
                straight away (the fewest calls).
            workspace_root: Where workspaces are made (default ``$TMPDIR/lit_marl_swe``).
            tests: How tests run (``scoring.TestSettings``: seconds per test and per run, memory,
                processes, file and disk sizes, retries of a run that gives no report).
            command_limits: The sandbox of a ``run`` command (``sandbox.Limits`` fields: ``memory_mb``
                1024, ``processes`` 64, ``file_mb`` 16, ``disk_mb`` 64); its time is ``command_timeout_s``.
            tool_mode: ``text``: one command per reply in the format the first observation shows (``HELP``);
                ``tools``: the same tools in the model's own tool-call format (``tool_mode.SWE_TOOLS``,
                docs/tools.md), several calls per reply, each one of the ``max_steps``.
            tool_parser: ``tools`` mode: how replies are read (``auto`` or a parser's name).
        """
        check_fields("data.env_kwargs", SWEEnv.__init__, locals())
        if not SITE:
            raise ValueError("the swe environment runs the repositories' tests with pytest: pip install pytest")
        base = Limits(wall_s=command_timeout_s, cpu_s=int(command_timeout_s) + 1, memory_mb=1024, processes=64,
                      file_mb=16, disk_mb=64, output_chars=4 * max_observation_chars)  # fmt: skip
        try:
            self.command_limits = replace(base, **(command_limits or {}))
        except TypeError as err:
            raise ConfigError(f"data.env_kwargs.command_limits={command_limits!r}: {err}") from err
        self.repos_dir, self.reward, self.max_steps = repos_dir, reward, max_steps
        self.max_observation_chars, self.max_output_chars = max_observation_chars, max_output_chars
        self.command_timeout_s, self.workspace_mb, self.list_tests = command_timeout_s, workspace_mb, list_tests
        self.expert_view_context = expert_view_context
        self.use_tool_mode(tool_mode, tool_parser, SWE_TOOLS)  # its calls run here (``act``), not as commands
        self.root = Path(workspace_root) if workspace_root else default_root()
        self.tests = tests if isinstance(tests, TestSettings) else TestSettings(**(tests or {}))
        with _sweep_lock:  # workspaces of killed runs go before this process makes its own
            if str(self.root) not in _swept:
                _swept.add(str(self.root))
                sweep(self.root)
        self.ws: Workspace | None = None
        self.row: dict | None = None
        self.base: dict | None = None
        self.result: Score | None = None
        self.steps = self.output = 0
        self.counts: dict[str, float] = {}

    # ------------------------------------------------------------------ episode
    def start(self, task: dict) -> list[str]:
        self.close()
        self.row = normalize(dict(task), f"instance {task.get('instance_id', '?')}")
        self.base = snapshot(self.row, self.repos_dir)
        self.ws = Workspace(self.root, self.base)
        self.result, self.steps, self.output = None, 0, 0
        self.counts = dict.fromkeys(("tool_errors", "harness_retries", "agent_crashes", "tampered", "submitted"), 0.0)
        return [self._first_observation()]

    def _first_observation(self) -> str:
        """The task, within ``max_observation_chars``: the listed tests (when ``list_tests``) and the
        tool help always whole; the file list is cut first, then the problem statement, each with a
        marker. Only when the tests and the help alone pass the limit does the observation pass it."""
        visible, hidden = self.row["PASS_TO_PASS"], len(self.row["FAIL_TO_PASS"])
        head = f"Fix the repository {self.row['repo']} so that its tests pass."
        kept = [f"Tests that must keep passing: {', '.join(visible) or 'none'}. {hidden} more, hidden until your "
                "changes are scored, check the fix the problem describes."] if self.list_tests else []  # fmt: skip
        kept += [TOOLS_HELP if self.tools else HELP, f"You have {self.max_steps} tool calls."]
        problem = self.row["problem_statement"].strip()
        room = self.max_observation_chars - sum(len(p) + 2 for p in [head, *kept]) - len("Problem:\n\n\nFiles: ")
        reserve = min(len(problem), 300) + 40  # the problem's first lines outrank the rest of the file list
        shown = file_list(sorted(self.base), max(room - len(problem), room - reserve, 0))
        if len(problem) > room - len(shown):
            problem = cut(problem, max(room - len(shown) - 40, 30))  # the marker takes up to 40
        return "\n\n".join([head, f"Problem:\n{problem}", f"Files: {shown}", *kept])

    def _observe(self, text: str, count: bool = True) -> str:
        text = cut(text, self.max_observation_chars)
        if count:
            self.output += len(text)
        return text

    def _info(self) -> dict:
        done = self.result
        resolved = bool(done and done.resolved)
        value = (done.fraction if self.reward == "fraction" else float(resolved)) if done else 0.0
        return {"won": resolved, "lost": False, "score": value, "max_score": 1, "counts": dict(self.counts)}

    def act(self, actions: list) -> StepResult:
        if self.ws is None or self.result is not None:
            raise RuntimeError("SWEEnv.step before reset or after the episode ended")
        if self.tools:
            return self._act_tools(actions[0])
        self.steps += 1
        ended, call = "", None
        try:
            call = parse(actions[0])
            if call.name == "submit":
                self.counts["submitted"] = 1.0
                return self._end("submitted", terminated=True)
            text = self._run_tool(call)
        except ToolError as err:
            self.counts["tool_errors"] += 1
            text = f"error: {err}"
        if call is not None and call.name == "run" and self.ws.size_bytes() > self.workspace_mb * 1024 * 1024:
            ended = f"the workspace passed {self.workspace_mb} MB"
        elif self.steps >= self.max_steps:
            ended = f"that was tool call {self.steps} of {self.max_steps}"
        elif self.output + len(text) > self.max_output_chars:
            ended = f"the episode's output passed {self.max_output_chars} characters"
        if ended:
            return self._end(ended, terminated=False, last=text)
        observation = self._observe(text) + f"\n[tool call {self.steps} of {self.max_steps}]"
        return StepResult([observation], info=self._info())

    def _act_tools(self, reply) -> StepResult:
        """``tool_mode: tools``: each call of the reply in order, each one step, each result a tool message."""
        reply = read_text(reply, self.tool_parser)
        results = [failed(error) for error in reply.errors]
        if not reply.calls and not reply.errors:
            results.append(failed("no tool call: call a tool (submit when done)"))
        self.counts["tool_errors"] += len(results)
        for call in reply.calls:
            self.steps += 1
            if call.name == "submit":
                self.counts["submitted"] = 1.0
                return self._end("submitted", terminated=True)
            try:
                text, broken = self._run_call(call), False
            except ToolError as err:
                self.counts["tool_errors"] += 1
                text, broken = f"error: {err}", True
            results.append(ToolResult(call, self._observe(text), broken))
            ended = self._ended(call.name)
            if ended:
                return self._end(ended, terminated=False)
        if results:
            last = results[-1]
            results[-1] = replace(last, text=f"{last.text}\n[tool call {self.steps} of {self.max_steps}]")
        return StepResult([ToolResults(tuple(results))], info=self._info())

    def _ended(self, tool: str) -> str:
        """Why the episode ends after a call of ``tool`` ("": it goes on)."""
        if tool == "run" and self.ws.size_bytes() > self.workspace_mb * 1024 * 1024:
            return f"the workspace passed {self.workspace_mb} MB"
        if self.steps >= self.max_steps:
            return f"that was tool call {self.steps} of {self.max_steps}"
        if self.output > self.max_output_chars:
            return f"the episode's output passed {self.max_output_chars} characters"
        return ""

    def _run_call(self, call) -> str:
        """A tools-mode call run by the same code as its text command."""
        args = arguments_of(call)
        if call.name == "view":
            numbers = [str(args.get("start", 1))] + ([str(args["end"])] if args.get("end") is not None else [])
            return FILE_TOOLS["view"](self.ws, ToolCall("view", [args["path"], *numbers], "", []))
        if call.name == "search":
            return search_text(self.ws, args["text"], args.get("path"))
        if call.name == "replace":
            return replace_text(self.ws, args["path"], args["search"], args["replace"])
        if call.name == "insert":
            return insert_text(self.ws, args["path"], int(args["line"]), args["content"])
        if call.name == "create":
            return create_text(self.ws, args["path"], args["content"])
        if call.name == "run":
            return self._run_tool(ToolCall("run", [], str(args["command"]).strip(), []))
        return self._run_tool(ToolCall("test", [], "", []))

    def _run_tool(self, call: ToolCall) -> str:
        if call.name in FILE_TOOLS:
            return FILE_TOOLS[call.name](self.ws, call)
        if call.name == "run":
            if not call.rest:
                raise ToolError("run: give the shell command on the same line, e.g. 'run ls tests'")
            site = tools_site(self.tests.packages)
            result = run_in(["/bin/bash", "-c", call.rest], str(self.ws.path), self.command_limits, read_only=(site,),
                            env={"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
            status = (
                "timed out" if result.timed_out else "output limit" if result.output_overflow else result.returncode
            )
            return f"$ {call.rest}\n{result.stdout}{result.stderr}[exit {status}]"
        # test: the visible listed tests (PASS_TO_PASS) on the workspace as it is; scoring uses a fresh copy
        listed = list(dict.fromkeys(self.row["PASS_TO_PASS"]))
        if not listed:
            return "no visible tests: write your own and run them (run python -m pytest FILE)"
        current = self.ws.files()
        changed = {path: data for path, data in current.items() if self.base.get(path, (None,))[0] != data}
        report, result = run_tests(
            self.ws, listed, self.row["test_args"], self.tests, changed_lines(self.base, changed)
        )
        if report is None or not report.complete:
            return f"the tests gave no complete report (timed out: {result.timed_out}):\n{result.stderr[-800:]}"
        lines = [f"{report.outcomes.get(test, 'missing'):8s} {test}" for test in listed]
        refused = f"refused by the harness: {'; '.join(report.tampered)}\n" if report.tampered else ""
        return refused + "\n".join(lines) + "\n\n" + report.log[-self.max_observation_chars // 2 :]

    def _end(self, why: str, terminated: bool, last: str = "") -> StepResult:
        self._score()
        done = self.result
        summary = f"{why}: {done.passed} of {len(done.outcomes)} tests pass" + (" (resolved)" if done.resolved else "")
        text = (self._observe(last) + "\n\n" if last else "") + summary
        return StepResult([text], terminated=terminated, truncated=not terminated, info=self._info())

    def _score(self) -> None:
        """Score the workspace (once) and remove it."""
        if self.result is None:
            result = score(self.row, self.base, self.ws.files(), self.root, self.tests)
            self.counts["harness_retries"] += result.retries
            self.counts["agent_crashes"] += float(result.agent_crash)
            self.counts["tampered"] = float(bool(result.tampered))
            self.result = result
        self.ws.remove()

    def finish(self) -> dict | None:
        """The rollout ended the episode (its turn or context budget): score the changes now."""
        if self.ws is None or self.result is not None:
            return None
        self._score()
        return self._info()

    def close(self) -> None:
        if self.ws is not None:
            self.ws.remove()

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The known fix (the row's ``patch``) as tool calls, one per hunk (after a ``view`` of its lines
        with ``expert_view_context``), then ``submit``."""
        row = normalize(dict(task), f"instance {task.get('instance_id', '?')}")
        if not row["patch"]:
            raise ValueError(f"instance {row['instance_id']}: no patch, so no expert")
        base = {path: data for path, (data, _) in snapshot(row, self.repos_dir).items()}
        calls = as_calls(parse_patch(row["patch"]), base, self.expert_view_context)
        if self.tools:  # the same calls in the format this environment reads
            return [[format_calls([from_text_call(call)], self.tool_parser)] for call in calls]
        return [[call] for call in calls]

    def clone(self) -> "SWEEnv":
        twin = object.__new__(SWEEnv)
        twin.__dict__.update(self.__dict__)
        twin.counts = dict(self.counts)
        twin.ws = self.ws.copy() if self.ws is not None and not self.ws.removed else None
        return twin


def workspaces(root: str | None = None) -> list[str]:
    """The workspace folders under ``root`` (for checks that none is left behind)."""
    folder = Path(root) if root else default_root()
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
