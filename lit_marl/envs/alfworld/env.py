"""ALFWorld (text) as a stateful ``Env``: one tw-pddl game per task row, played through
TextWorld's PDDL backend with ALFWorld's own wrappers, offline.

A task row is ``{"game": "<path>/game.tw-pddl", "task_type": ...}`` (``games.py`` writes the
project's games; ``alfworld-data:<split>`` lists the official ones). The observation is ALFWorld's
own text ("You are in the middle of a room. Looking quickly around you, you see ... Your task is to:
..."), then the game's feedback each turn. Commands use ALFWorld >= 0.4's syntax, ``move X to Y``;
the older ``put X in/on Y`` is accepted and mapped to it. ``won`` comes from the game (an ALFWorld
game has no loss and no partial score: ``score`` is 1 on a win, ``max_score`` 1). ``expert_turns``
is the game's walkthrough (the planner's plan when a game has none). The PDDL engine cannot copy
its state, so trees branch these games by replay (``data.env.branch: replay``).
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

from lit_marl.envs.alfworld.actions import ALFWORLD_COMMANDS
from lit_marl.envs.alfworld.games import resolve_source, start_game
from lit_marl.envs.base import register
from lit_marl.envs.game import Game, StepResult
from lit_marl.envs.textworld.env import sanitize, state_digest
from lit_marl.tools.formats import ParserName

_BANNER = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_OLD_PUT = re.compile(r"^put (.+?) (?:in on|in|on|into|onto) (.+)$")  # "in/on" arrives sanitized
_ENGINE = threading.Lock()
"""Loading a game runs Fast Downward's translator, which swaps ``sys.stdout`` and ``sys.argv``
while it works: loads and steps hold this lock (a step takes ~10 ms)."""
_FIELDS = ("pddl_domain", "grammar", "pddl_problem")
_PATH_MEMORY = re.compile(r"^(checked|examined|wasinreceptacle|not_\w+)\(", re.IGNORECASE)
"""Facts that remember how the agent got somewhere rather than where things are."""


def to_current_syntax(command: str) -> str:
    """ALFWorld < 0.4's ``put X in/on Y`` as the current ``move X to Y``; anything else as it is."""
    found = _OLD_PUT.match(command)
    return f"move {found.group(1)} to {found.group(2)}" if found else command


def check_game_file(path: str) -> dict:
    """The tw-pddl JSON of ``path``, or an error naming the task field and what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"task['game']={path!r}: no such ALFWorld game; write the project's games with "
            "scripts/make_alfworld_games.py or name a set (data.train_path: alfworld:train:8)"
        )
    try:
        data = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"task['game']={path!r}: not a tw-pddl game (not JSON: {err})") from err
    missing = [key for key in _FIELDS if not isinstance(data, dict) or not isinstance(data.get(key), str)]
    if missing:
        raise ValueError(f"task['game']={path!r}: not a tw-pddl game (no {', '.join(missing)})")
    return data


@register("alfworld")
class AlfWorldEnv(Game):
    """An ALFWorld text game (one tw-pddl game per task row), played offline by one agent; won or not."""

    task_sets = ("alfworld", "alfworld-data")
    demo_packages = ("textworld", "alfworld")
    resolve_set = staticmethod(resolve_source)

    num_agents = 1
    cloneable = False
    commands = ALFWORLD_COMMANDS

    def __init__(
        self,
        admissible_commands: bool = False,
        max_feedback_chars: int = 2000,
        tool_mode: str = "text",
        tool_parser: ParserName = "auto",
    ):
        """
        Args:
            admissible_commands: Append the game's list of valid commands to every observation
                (ALFWorld's text agents often see it; off by default, as in the guide).
            max_feedback_chars: Cut the game's text of one turn at this many characters.
            tool_mode: ``text``: one command per reply; ``tools``: the game's verbs as tools in the model's own
                tool-call format (``alfworld.actions``), one call a turn (docs/tools.md).
            tool_parser: ``tools`` mode: how replies are read (``auto`` or a parser's name).
        """
        self.admissible_commands = admissible_commands
        self.max_feedback_chars = max_feedback_chars
        self.use_tool_mode(tool_mode, tool_parser)
        self._game = None
        self._task: dict | None = None

    def _start(self, path: str, policy_commands: bool = False):
        check_game_file(path)
        try:
            with _ENGINE:
                game = start_game(path, self.admissible_commands, policy_commands, facts=True)
                state = game.reset()
        except (Exception, SystemExit) as err:  # the translator exits on a malformed problem
            raise ValueError(
                f"task['game']={path!r}: not a playable ALFWorld game ({type(err).__name__}: {err})"
            ) from err
        return game, state

    def observe(self, state, text: str) -> str:
        text = _BANNER.sub("", text or "").strip()[: self.max_feedback_chars]
        if self.admissible_commands and state["admissible_commands"]:
            text += "\n\nValid commands: " + ", ".join(state["admissible_commands"])
        return text

    def start(self, task: dict) -> list[str]:
        if "game" not in task:
            raise KeyError(f"an ALFWorld task row needs the field 'game' (a .tw-pddl path); got {sorted(task)}")
        self._task = task
        self._game, self._state = self._start(str(task["game"]))
        state = self._state
        return [self.observe(state, state["feedback"])]

    def act(self, actions: list[str]) -> StepResult:
        if self._game is None:
            raise RuntimeError("AlfWorldEnv.step before reset")
        command = to_current_syntax(sanitize(actions[0]))
        with _ENGINE:
            state, _, done = self._game.step(command)
        self._state = state
        won = bool(state["won"])
        info = {"won": won, "lost": False, "score": int(won), "max_score": 1}
        return StepResult([self.observe(state, state["feedback"])], terminated=bool(done or won), info=info)

    def state_key(self) -> str:
        """The PDDL facts that hold (where the agent and every object are, what is open, hot, clean,
        held), without the domain's memory of the path (``checked``, ``examined``,
        ``wasInReceptacle``, ``not_*``): equal whatever the commands that led there."""
        return state_digest(f for f in self._state["facts"] if not _PATH_MEMORY.match(str(f)))

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The game's walkthrough, one command per turn (the planner's plan when it has none)."""
        walkthrough = check_game_file(str(task["game"])).get("walkthrough")
        if not walkthrough:
            _, state = self._start(str(task["game"]), policy_commands=True)
            walkthrough = state["policy_commands"]
        if not walkthrough:
            raise ValueError(f"task['game']={task['game']!r}: the game has no walkthrough and no plan")
        return [[command] for command in walkthrough]
