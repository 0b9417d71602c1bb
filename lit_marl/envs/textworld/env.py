"""TextWorld as a stateful ``Env``: one generated game per task row, played through TextWorld's
own engine (Inform 7 compiled to a Z-machine file, run by Jericho), offline.

A task row is ``{"game": "<path>.z8", ...}`` (``lit_marl.envs.textworld.games`` writes them).
``won``, ``lost``, ``score`` and ``max_score`` come from the game itself (tw-simple: eating the
food is a loss, not a win); ``step`` makes the rewards from them by ``data.reward_density``
(``RewardRule``), as every game. ``expert_turns`` is the game's walkthrough. ``clone`` copies the Z-machine state
(independent games from then on); ``replay_clone`` rebuilds the state by replaying the commands
played so far, the fallback for a backend that cannot copy.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
import threading
import warnings
from pathlib import Path

from lit_marl.envs.base import register
from lit_marl.envs.game import Game, StepResult
from lit_marl.envs.textworld.actions import TEXTWORLD_COMMANDS
from lit_marl.envs.textworld.games import resolve_source
from lit_marl.tools.formats import ParserName

_PROMPT_LINE = re.compile(r"^\s*>")  # the parser's prompt (and the status line printed after it)
_RESTART = re.compile(r"Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command\?")
_COMMAND_CHARS = re.compile(r"[^a-z0-9 ,.'-]")
MAX_COMMAND_CHARS = 160  # walkthroughs name objects like "henderson's limited edition latchkey" twice
_ENGINE = threading.RLock()
"""TextWorld's game loading (its grammar parser) is not thread-safe: every call into the engine
holds this lock. A step takes ~2 ms against seconds of generation, so the rollouts' thread pool
loses nothing measurable by it."""


def sanitize(text: str) -> str:
    """One command from a reply: its first non-empty line, lower case, only letters, digits and
    ``,.'-`` (the Z-machine parser reads other characters as escapes or commands of their own),
    at most 160 characters. An empty reply becomes ``look`` (the game then only describes the room)."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "")
    line = _COMMAND_CHARS.sub(" ", line.lower())
    line = " ".join(line.split())[:MAX_COMMAND_CHARS].strip(" ,.'-")
    return line or "look"


def clean(feedback: str) -> str:
    """Game text without the start banner, the trailing ``>`` prompt and runs of blank lines."""
    text = feedback
    if "$$" in text:
        match = list(re.finditer(r"\$\$[^\n]*\n", text))
        text = text[match[-1].end() :] if match else text
    text = _RESTART.sub("", text)
    lines = [line.rstrip() for line in text.splitlines() if not _PROMPT_LINE.match(line)]
    return re.sub(r"\n\s*\n+", "\n\n", "\n".join(lines)).strip()


def check_story_file(path: str) -> None:
    """Refuse a file that is not an intact Z-machine story before the engine sees it: Jericho reads
    a bad file in C and takes the whole process down, not just the episode. The header's version
    (byte 0) must be 1-8, its file length (bytes 0x1A-0x1B, in units of 2, 4 or 8 bytes by version)
    must fit the file, and its checksum (bytes 0x1C-0x1D: the sum of the bytes from 0x40 to that
    length, mod 65536) must match, so a body damaged behind a good header is refused too."""
    stat = os.stat(path)
    problem = _story_problem(path, stat.st_mtime_ns, stat.st_size)
    if problem:
        raise ValueError(f"task['game']={path!r}: not a playable TextWorld game ({problem})")


@functools.lru_cache(maxsize=None)  # a few bytes per game file
def _story_problem(path: str, mtime_ns: int, size: int) -> str | None:
    """What is wrong with the story file (None: nothing); cached per file version."""
    with open(path, "rb") as handle:
        data = handle.read()
    version = data[0] if data else 0
    if len(data) < 64 or not 1 <= version <= 8:
        return "no Z-machine header"
    scale = 2 if version <= 3 else 4 if version <= 5 else 8
    length = int.from_bytes(data[0x1A:0x1C], "big") * scale
    if not 64 < length <= len(data):
        return f"its header gives {length} bytes, the file has {len(data)}: cut short or not a story file"
    expected = int.from_bytes(data[0x1C:0x1E], "big")
    if expected and sum(data[0x40:length]) & 0xFFFF != expected:
        return "its checksum does not match its bytes: the file is damaged"
    return None


def state_digest(facts) -> str:
    """A short digest of a set of TextWorld propositions (order-free)."""
    return hashlib.sha1("\n".join(sorted(map(str, facts))).encode()).hexdigest()[:16]


def room_of(description: str) -> str:
    """The room's name from its description header ``-= Studio =-``."""
    found = re.search(r"-=\s*(.+?)\s*=-", description)
    return found.group(1) if found else "room"


@register("textworld")
class TextWorldEnv(Game):
    """A generated TextWorld game (one Z-machine story per task row), played offline by one agent."""

    task_sets = ("textworld",)
    demo_packages = ("textworld",)
    resolve_set = staticmethod(resolve_source)

    num_agents = 1
    cloneable = True
    commands = TEXTWORLD_COMMANDS

    def __init__(
        self,
        admissible_commands: bool = False,
        objective: bool = True,
        tool_mode: str = "text",
        tool_parser: ParserName = "auto",
    ):
        """
        Args:
            admissible_commands: Append the game's list of valid commands to every observation (the
                guide plays without it: the agent must write commands from the text alone).
            objective: Start the first observation with the game's objective.
            tool_mode: ``text``: one command per reply; ``tools``: the game's verbs as tools in the model's own
                tool-call format (``textworld.actions``), one call a turn (docs/tools.md).
            tool_parser: ``tools`` mode: how replies are read (``auto`` or a parser's name).
        """
        self.admissible_commands = admissible_commands
        self.objective = objective
        self.use_tool_mode(tool_mode, tool_parser)
        self._game = None
        self._path: str | None = None
        self._played: list[str] = []

    # ------------------------------------------------------------------ the game
    def _start(self, path: str):
        # deferred: importing textworld costs 0.6 s of start-up that runs which never play it skip
        import textworld

        if not Path(path).is_file():
            raise FileNotFoundError(
                f"task['game']={path!r}: no such game file; generate the games with "
                "scripts/make_textworld_games.py (or lit_marl.envs.textworld.games.write_tasks)"
            )
        check_story_file(path)
        infos = textworld.EnvInfos(
            won=True,
            lost=True,
            score=True,
            max_score=True,
            objective=True,
            description=True,
            inventory=True,
            feedback=True,
            facts=True,  # the world's propositions, the canonical state (state_key): ~1-3 ms more a step (measured)
            admissible_commands=self.admissible_commands,
            extras=["walkthrough"],
        )
        try:
            with _ENGINE, warnings.catch_warnings():
                # Jericho's own score detection does not know generated games; TextWorld's is used
                warnings.filterwarnings("ignore", message=r".*is not fully supported", category=UserWarning)
                game = textworld.start(path, request_infos=infos)
                state = game.reset()
        except Exception as err:  # a corrupt or foreign file: the engine's own errors vary
            raise ValueError(
                f"task['game']={path!r}: not a playable TextWorld game ({type(err).__name__}: {err})"
            ) from err
        return game, state

    def start(self, task: dict) -> list[str]:
        if "game" not in task:
            raise KeyError(f"a TextWorld task row needs the field 'game' (a .z8 path); got {sorted(task)}")
        self._path, self._played = str(task["game"]), []
        self._game, state = self._start(self._path)
        self._state = state
        parts = [clean(state["objective"])] if self.objective and state["objective"] else []
        return [self.observe(state, parts)]

    def observe(self, state, lead: list[str] | None = None) -> str:
        """The room, what just happened, what the player carries (and the valid commands)."""
        description = state["description"] or ""
        parts = list(lead or [])
        parts += [f"You are in the {room_of(description)}.", clean(description), clean(state["inventory"] or "")]
        if self.admissible_commands and state["admissible_commands"]:
            parts.append("Valid commands: " + ", ".join(state["admissible_commands"]))
        return "\n\n".join(p for p in parts if p)

    def outcome(self) -> dict:
        return self.info(self._state)

    def info(self, state) -> dict:
        return {
            "won": bool(state["won"]),
            "lost": bool(state["lost"]),
            "score": int(state["score"] or 0),
            "max_score": int(state["max_score"] or 0),
        }

    def act(self, actions: list[str]) -> StepResult:
        if self._game is None:
            raise RuntimeError("TextWorldEnv.step before reset")
        command = sanitize(actions[0])
        with _ENGINE:
            state, _, done = self._game.step(command)
        self._played.append(command)
        self._state = state
        feedback = clean(state.feedback or "")
        info = self.info(state)
        return StepResult(
            [self.observe(state, [feedback])], terminated=bool(done or info["won"] or info["lost"]), info=info
        )

    def state_key(self) -> str:
        """The game's world as its set of true propositions (where the player and every object
        are, what is open, what is carried): equal whatever the commands that led there."""
        return state_digest(self._state["facts"])

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The game's own walkthrough, one command per turn."""
        _, state = self._start(str(task["game"]))
        walkthrough = state["extra.walkthrough"]
        if not walkthrough:
            raise ValueError(f"task['game']={task['game']!r}: the game has no walkthrough")
        return [[command] for command in walkthrough]

    # ------------------------------------------------------------------ branching
    def _like(self) -> "TextWorldEnv":
        twin = copy.copy(self)  # the settings and any subclass's own fields; the game is replaced
        twin._played = list(self._played)
        return twin

    def clone(self) -> "TextWorldEnv":
        """An independent copy of the game in its current state (the Z-machine's state copied)."""
        twin = self._like()
        with _ENGINE:
            twin._game = self._game.copy() if self._game is not None else None
        return twin

    def replay_clone(self) -> "TextWorldEnv":
        """The same state rebuilt by starting the game again and replaying the commands played."""
        twin = self._like()
        twin._game, state = self._start(self._path)
        with _ENGINE:
            for command in self._played:
                state, _, _ = twin._game.step(command)
        twin._state = state
        return twin


PLANNER = "You are the planner. Reply with a short plan (one sentence) for the next command."
ACTOR = "You are the actor. Reply with one command for the game."


@register("textworld-team")
class PlannerActorTextWorld(TextWorldEnv):
    """Two agents on one game: a planner reads the observation and writes a short plan; an actor
    reads the observation and the planner's latest plan and issues the command, which is what the
    game plays. Both act at each turn at once, so the actor follows the plan written the turn
    before (none at the first turn). The joint reward is the game's."""

    num_agents = 2

    def start(self, task: dict) -> list[str]:
        observation = super().start(task)[0]
        return [f"{observation}\n\n{PLANNER}", f"{observation}\n\n{ACTOR}"]

    def act(self, actions: list[str]) -> StepResult:
        plan, command = actions
        result = super().act([command])
        observation = result.observations[0]
        plan = " ".join(plan.split())[:300]
        result.observations = [
            f"{observation}\n\n{PLANNER}",
            f"{observation}\n\nThe planner's plan: {plan}\n\n{ACTOR}",
        ]
        return result

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The walkthrough for the actor; for the planner, the command after the current one."""
        commands = [turn[0] for turn in super().expert_turns(task)]
        plans = [f"Next: {nxt}." for nxt in commands[1:]] + ["Finish the quest."]
        return [[plan, command] for plan, command in zip(plans, commands)]
