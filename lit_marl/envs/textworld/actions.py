"""TextWorld's actions as tools (``tool_mode: tools``): each function describes one verb of the
game's parser (the schema the agent's chat template renders); the forms beside it are the commands
a call writes, the very text a text-mode reply would hold (``lit_marl.envs.commands``)."""

from __future__ import annotations

from typing import Literal

from lit_marl.envs.commands import commands


def look() -> str:
    """Describe the room you are in."""


def inventory() -> str:
    """List what you carry."""


def go(direction: Literal["north", "south", "east", "west"]) -> str:
    """Walk through an exit of the room.

    Args:
        direction: The exit to take.
    """


def examine(thing: str) -> str:
    """Look closely at something.

    Args:
        thing: What to examine, as the game names it.
    """


def take(item: str, source: str | None = None) -> str:
    """Pick something up, from the floor or from a container or supporter.

    Args:
        item: What to take.
        source: The container or supporter it is in or on (leave out when it lies on the floor).
    """


def drop(item: str) -> str:
    """Put down something you carry.

    Args:
        item: What to drop.
    """


def put(item: str, target: str) -> str:
    """Put something you carry on a supporter (a table, a shelf).

    Args:
        item: What to put.
        target: The supporter to put it on.
    """


def insert(item: str, target: str) -> str:
    """Put something you carry into a container (a box, a chest).

    Args:
        item: What to insert.
        target: The container to put it into.
    """


def open(thing: str) -> str:  # noqa: A001 - the game's verb
    """Open a door or a container.

    Args:
        thing: What to open.
    """


def close(thing: str) -> str:
    """Close a door or a container.

    Args:
        thing: What to close.
    """


def unlock(thing: str, key: str) -> str:
    """Unlock a door or a container with a key you carry.

    Args:
        thing: What to unlock.
        key: The key to use.
    """


def lock(thing: str, key: str) -> str:
    """Lock a door or a container with a key you carry.

    Args:
        thing: What to lock.
        key: The key to use.
    """


def eat(item: str) -> str:
    """Eat something edible you carry.

    Args:
        item: What to eat.
    """


TEXTWORLD_COMMANDS = commands(
    (look, "look"),
    (inventory, "inventory"),
    (go, "go {direction}"),
    (examine, "examine {thing}"),
    (take, ("take {item} from {source}", "take {item}")),
    (drop, "drop {item}"),
    (put, "put {item} on {target}"),
    (insert, "insert {item} into {target}"),
    (open, "open {thing}"),
    (close, "close {thing}"),
    (unlock, "unlock {thing} with {key}"),
    (lock, "lock {thing} with {key}"),
    (eat, "eat {item}"),
)
"""TextWorld's verbs, in the order the agent's tool list shows them."""
