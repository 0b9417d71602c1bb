"""ALFWorld's actions as tools (``tool_mode: tools``): each function describes one verb of the
game (the schema the agent's chat template renders); the forms beside it are the commands a call
writes, the very text a text-mode reply would hold (``lit_marl.envs.commands``). Objects and places
are named as the game names them, with their number (``cabinet 1``, ``apple 2``)."""

from __future__ import annotations

from lit_marl.envs.commands import commands


def look() -> str:
    """Describe where you are and what you see."""


def inventory() -> str:
    """List what you carry."""


def go_to(place: str) -> str:
    """Walk to a receptacle or a place in the room.

    Args:
        place: Where to go, e.g. "countertop 1".
    """


def examine(thing: str) -> str:
    """Look closely at an object or a receptacle.

    Args:
        thing: What to examine, e.g. "drawer 2".
    """


def take(item: str, source: str) -> str:
    """Pick an object up from where it is.

    Args:
        item: The object, e.g. "apple 1".
        source: The receptacle it is in or on, e.g. "fridge 1".
    """


def move(item: str, target: str) -> str:
    """Put an object you carry in or on a receptacle.

    Args:
        item: The object you carry.
        target: The receptacle, e.g. "diningtable 1".
    """


def open(thing: str) -> str:  # noqa: A001 - the game's verb
    """Open a receptacle (a fridge, a drawer, a microwave).

    Args:
        thing: What to open.
    """


def close(thing: str) -> str:
    """Close a receptacle.

    Args:
        thing: What to close.
    """


def toggle(thing: str) -> str:
    """Switch an appliance or a light on or off.

    Args:
        thing: What to switch.
    """


def use(thing: str) -> str:
    """Use an object, e.g. turn on a desk lamp.

    Args:
        thing: What to use.
    """


def heat(item: str, appliance: str) -> str:
    """Heat an object you carry with an appliance (a microwave).

    Args:
        item: The object.
        appliance: The appliance, e.g. "microwave 1".
    """


def cool(item: str, appliance: str) -> str:
    """Cool an object you carry with an appliance (a fridge).

    Args:
        item: The object.
        appliance: The appliance, e.g. "fridge 1".
    """


def clean(item: str, basin: str) -> str:
    """Clean an object you carry in a basin.

    Args:
        item: The object.
        basin: The basin, e.g. "sinkbasin 1".
    """


def slice(item: str, tool: str) -> str:  # noqa: A001 - the game's verb
    """Slice an object with a knife you carry.

    Args:
        item: The object to slice.
        tool: The knife.
    """


ALFWORLD_COMMANDS = commands(
    (look, "look"),
    (inventory, "inventory"),
    (go_to, "go to {place}"),
    (examine, "examine {thing}"),
    (take, "take {item} from {source}"),
    (move, ("move {item} to {target}", "put {item} in/on {target}")),
    (open, "open {thing}"),
    (close, "close {thing}"),
    (toggle, "toggle {thing}"),
    (use, "use {thing}"),
    (heat, "heat {item} with {appliance}"),
    (cool, "cool {item} with {appliance}"),
    (clean, "clean {item} with {basin}"),
    (slice, "slice {item} with {tool}"),
)
"""ALFWorld's verbs, in the order the agent's tool list shows them."""
