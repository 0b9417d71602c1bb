"""Corridor: a small deterministic text game with milestone scores (the built-in multi-turn env).

A corridor of ``length`` rooms; the last (east) room has a locked door to the exit, a key lies
in room ``key_room``. The player starts in room 0, or with ``pit`` in room 1, room 0 then being a
pit (walking west into it loses the game). Commands: ``east``, ``west``, ``take key``, ``open
door``, ``go out``. Score: +1 for taking the key, +1 for opening the door, +1 for going out (won);
max_score = 3. An unknown command changes nothing. The game's step limit truncates the episode.

A task row: ``{"length": 4, "key_room": 2, "pit": false, "max_steps": 12}``
(``scripts/make_corridor_tasks.py``). ``expert_actions(task)`` is the optimal play.
"""

from __future__ import annotations

import re

from lit_marl.envs.base import register
from lit_marl.envs.commands import commands
from lit_marl.envs.game import Game, StepResult
from lit_marl.tools.formats import ParserName

COMMANDS = ("take key", "open door", "go out", "east", "west")


def east() -> str:
    """Walk one room east."""


def west() -> str:
    """Walk one room west."""


def take_key() -> str:
    """Take the key lying in this room."""


def open_door() -> str:
    """Unlock the door of the last room with the key you carry."""


def go_out() -> str:
    """Leave through the open door: the game is won."""


CORRIDOR_COMMANDS = commands(
    (east, "east"), (west, "west"), (take_key, "take key"), (open_door, "open door"), (go_out, "go out")
)


def parse_command(text: str) -> str | None:
    """The first known command in the reply (case-insensitive), or None."""
    found = [(m.start(), c) for c in COMMANDS for m in [re.search(rf"\b{c}\b", text.lower())] if m]
    return min(found)[1] if found else None


@register("corridor")
class Corridor(Game):
    """A small deterministic text game: walk east, take the key, open the door, go out (one agent, score 0-3)."""

    num_agents = 1
    cloneable = True
    commands = CORRIDOR_COMMANDS

    def __init__(self, instructions: bool = True, tool_mode: str = "text", tool_parser: ParserName = "auto"):
        """
        Args:
            instructions: Start the first observation with the rules and the commands.
            tool_mode: ``text``: one command per reply; ``tools``: the commands as tools in the model's own
                tool-call format, one call a turn (docs/tools.md).
            tool_parser: ``tools`` mode: how replies are read (``auto`` or a parser's name).
        """
        self.instructions = instructions
        self.use_tool_mode(tool_mode, tool_parser)

    def start(self, task: dict) -> list[str]:
        self.length = int(task["length"])
        self.key_room = int(task["key_room"])
        self.pit = bool(task.get("pit", False))
        self.max_steps = int(task.get("max_steps", 4 * self.length))
        start = int(self.pit)
        if not start < self.key_room < self.length:
            raise ValueError(f"corridor task {task!r}: the key must lie east of the start and inside the corridor")
        self.room, self.has_key, self.door_open = start, False, False
        self.score, self.steps = 0, 0
        how = (
            "Act by calling one of the tools, one a turn."
            if self.tools
            else "Commands: east, west, take key, open door, go out. Reply with one command."
        )
        goal = "You are in a corridor of rooms. Find the key, open the door in the last room and go out."
        intro = f"{goal} {how}\n" if self.instructions else ""
        return [intro + self.describe()]

    def describe(self) -> str:
        things = []
        if self.room == self.key_room and not self.has_key:
            things.append("You see a key.")
        if self.room == self.length - 1:
            things.append("The door is open." if self.door_open else "There is a locked door.")
        if self.pit and self.room == 1:
            things.append("You feel a draft from the west.")
        exits = [d for d, ok in (("west", self.room > 0), ("east", self.room < self.length - 1)) if ok]
        return " ".join([f"Room {self.room + 1} of {self.length}.", *things, f"Exits: {', '.join(exits)}."])

    def state_key(self) -> str:
        """Where the player is and what it has done; not the step count (GiGPO's grouping)."""
        return f"room={self.room} key={self.has_key} door={self.door_open}"

    def outcome(self) -> dict:
        return self.info()

    def info(self, won: bool = False, lost: bool = False) -> dict:
        return {"won": won, "lost": lost, "score": self.score, "max_score": 3}

    def expert_turns(self, task: dict) -> list[list[str]]:
        return [[action] for action in expert_actions(task)]

    def act(self, actions: list[str]) -> StepResult:
        self.steps += 1
        command = parse_command(actions[0])
        message = "Nothing happens."
        if command == "east" and self.room < self.length - 1:
            self.room += 1
            message = "You walk east."
        elif command == "west" and self.room > 0:
            self.room -= 1
            if self.pit and self.room == 0:
                return StepResult(["You fall into a pit. Game over."], terminated=True, info=self.info(lost=True))
            message = "You walk west."
        elif command == "take key" and self.room == self.key_room and not self.has_key:
            self.has_key, self.score = True, self.score + 1
            message = "You take the key."
        elif command == "open door" and self.room == self.length - 1 and self.has_key and not self.door_open:
            self.door_open, self.score = True, self.score + 1
            message = "You unlock the door."
        elif command == "go out" and self.room == self.length - 1 and self.door_open:
            self.score += 1
            return StepResult(["You are out. You win!"], terminated=True, info=self.info(won=True))
        elif command is None:
            message = "I don't understand. Commands: east, west, take key, open door, go out."
        truncated = self.steps >= self.max_steps
        return StepResult([f"{message} {self.describe()}"], truncated=truncated, info=self.info())


def expert_actions(task: dict) -> list[str]:
    """The shortest winning command sequence."""
    length, key, start = int(task["length"]), int(task["key_room"]), int(bool(task.get("pit", False)))
    return ["east"] * (key - start) + ["take key"] + ["east"] * (length - 1 - key) + ["open door", "go out"]
