"""The text games' actions as tools (``tool_mode: tools``): a call writes the very command a
text-mode reply would be, the expert's commands read back into calls, one action a turn, and every
malformed, unknown, surplus or wrong call is an error result that plays nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_marl import ConfigError
from lit_marl.envs import make_env
from lit_marl.envs.alfworld.actions import ALFWORLD_COMMANDS
from lit_marl.envs.commands import CommandError, call_of
from lit_marl.envs.corridor import CORRIDOR_COMMANDS, Corridor
from lit_marl.envs.sources import resolve_source
from lit_marl.envs.textworld.actions import TEXTWORLD_COMMANDS
from lit_marl.returns import step_reward
from lit_marl.tools.calls import ToolResults
from lit_marl.tools.formats import ParsedReply, ToolCall, format_calls, parse_hermes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# walkthrough commands of generated games at w1-o1-q2, w2-o3-q4, w3-o5-q6 and ALFWorld's six task types
TEXTWORLD = [
    "go east", "take carrot", "take type J keycard from mantle", "unlock type M safe with type M latchkey",
    "insert broom into cabinet", "put sandwich on table", "open type J chest", "drop Advent Calendar",
    "eat berry", "look", "inventory", "examine box", "close trunk", "lock box with keycard",
]  # fmt: skip
ALFWORLD = [
    "go to countertop 1", "take creditcard 2 from drawer 1", "move egg 1 to diningtable 1", "open microwave 1",
    "heat tomato 1 with microwave 1", "cool apple 1 with fridge 1", "clean soapbar 1 with sinkbasin 1",
    "use desklamp 1", "toggle desklamp 1", "slice bread 1 with knife 1", "examine cellphone 1", "close drawer 2",
]  # fmt: skip


@pytest.mark.parametrize(
    ("actions", "command_list"),
    [(TEXTWORLD_COMMANDS, TEXTWORLD), (ALFWORLD_COMMANDS, ALFWORLD), (CORRIDOR_COMMANDS, ["east", "take key"])],
    ids=["textworld", "alfworld", "corridor"],
)
def test_every_expert_command_reads_as_a_call_that_writes_it_back(actions, command_list):
    by_name = {a.name: a for a in actions}
    for command in command_list:
        call = call_of(actions, command)
        assert by_name[call.name].write(call.arguments) == command
    assert call_of(TEXTWORLD_COMMANDS, "take key from box").arguments == {"item": "key", "source": "box"}
    # ALFWorld < 0.4's put reads as the move it is today
    assert call_of(ALFWORLD_COMMANDS, "put apple 1 in/on countertop 1") == ToolCall(
        "move", {"item": "apple 1", "target": "countertop 1"}
    )
    with pytest.raises(ValueError, match=r"the command 'dance' is none of the tools'"):
        call_of(actions, "dance")


def test_a_call_with_wrong_arguments_writes_no_command():
    by_name = {a.name: a for a in TEXTWORLD_COMMANDS}
    with pytest.raises(CommandError, match=r"go: direction must be one of north, south, east, west, got 'up'"):
        by_name["go"].write({"direction": "up"})
    with pytest.raises(CommandError, match=r"unlock: missing a required argument: 'key'"):
        by_name["unlock"].write({"thing": "box"})
    with pytest.raises(CommandError, match=r"take: item must be a non-empty text, got 3"):
        by_name["take"].write({"item": 3})
    with pytest.raises(CommandError, match=r"eat: got an unexpected keyword argument 'with'"):
        by_name["eat"].write({"item": "apple", "with": "fork"})
    # one action a turn: an argument cannot smuggle a second command past the game's parser
    for smuggled in ("trunk. take cd from trunk", "trunk, take cd", "trunk then take cd", "trunk; eat cd"):
        with pytest.raises(CommandError, match=r"open: thing must name one thing, without \. , ; or 'then'"):
            by_name["open"].write({"thing": smuggled})
    assert by_name["take"].write({"item": "apple", "source": None}) == "take apple"
    assert by_name["take"].write({"item": " red  apple "}) == "take red apple"


def _calls(*calls: ToolCall) -> str:
    return format_calls(list(calls))


def test_one_action_a_turn_and_every_bad_call_an_error_that_plays_nothing():
    game = Corridor(tool_mode="tools")
    first = game.start({"length": 3, "key_room": 1})[0]
    assert "Act by calling one of the tools" in first and "Reply with one command" not in first
    key = game.state_key()
    for reply, error in [
        ("I walk east.", "error: no tool call: act by calling one of east, west, take_key, open_door, go_out"),
        ("<tool_call>\n{walk\n</tool_call>", "error: tool call 1: not JSON"),
        (_calls(ToolCall("fly", {})), "error: no tool named 'fly'"),
        (_calls(ToolCall("east", {"fast": "yes"})), "error: east: got an unexpected keyword argument 'fast'"),
    ]:
        result = game.play([reply])
        assert isinstance(result.observations[0], ToolResults) and not result.terminated
        (only,) = result.observations[0].results
        assert only.error and only.text.startswith(error), only.text
        assert game.state_key() == key  # nothing was played
    # two calls: the first plays, the second is answered as not played
    result = game.play([parse_hermes(_calls(ToolCall("east", {}), ToolCall("take_key", {})))])
    east, key_call = result.observations[0].results
    assert not east.error and east.text.startswith("You walk east. Room 2 of 3. You see a key.")
    assert key_call.error and "not played: the game takes one action a turn" in key_call.text
    assert result.info["score"] == 0 and game.room == 1 and not game.has_key
    assert result.info["counts"] == {"calls": 4.0, "malformed": 1.0, "tool_errors": 4.0}
    for name in ("take_key", "east", "open_door"):
        result = game.play([ParsedReply("", [ToolCall(name, {})])])
    result = game.play([_calls(ToolCall("go_out", {}))])
    assert result.terminated and result.info["won"] and result.info["score"] == 3
    assert result.observations[0].results[0].text == "You are out. You win!"


def test_the_protocol_plays_and_replays_tool_turns():
    """Steps, rewards and a replayed branch in tools mode: a replay rebuilds the same state and counts."""
    env = make_env("corridor", {"tool_mode": "tools"})
    env.reward_rule = type(env.reward_rule)("dense")
    env.branching = "replay"
    (state,) = env.reset([{"length": 3, "key_room": 1}])
    replies = [_calls(ToolCall("east", {})), "no call", _calls(ToolCall("take_key", {}), ToolCall("east", {}))]
    rewards = [float(env.step([state], [[reply]], turn=t).rewards[0, 0]) for t, reply in enumerate(replies)]
    key_delta = step_reward(0, 1, 3, False, False, "dense", None)  # the key's milestone, as in text mode
    assert key_delta > 0 and rewards == [0.0, 0.0, pytest.approx(key_delta)]
    twin = env.branch(state)
    assert twin.game.state_key() == state.game.state_key() == "room=1 key=True door=False"
    assert twin.game._tool_counts == state.game._tool_counts == {"calls": 3.0, "malformed": 0.0, "tool_errors": 2.0}


def test_expert_demonstrations_play_as_tool_calls_and_win():
    """Every ALFWorld task type's plan, demonstrated as tool calls in Hermes's format, wins its game
    (``demonstration`` refuses an expert that does not; TextWorld's: tests/fit/test_tool_episodes.py)."""
    env = make_env("alfworld", {"tool_mode": "tools"})
    for row in (json.loads(line) for line in Path(resolve_source("alfworld:test:1")).read_text().splitlines()):
        (chat,) = env.demonstration(row)
        turns = [m for m in chat if m["role"] == "assistant"]
        assert all(len(parse_hermes(m["content"]).calls) == 1 for m in turns)
        assert [m["role"] for m in chat[1:3]] == ["assistant", "tool"]
        assert chat[2]["name"] == parse_hermes(chat[1]["content"]).calls[0].name


def test_tools_mode_is_refused_where_a_game_has_none():
    with pytest.raises(ConfigError, match=r"data.env_kwargs.tool_mode='tool': choose text .* or tools"):
        make_env("corridor", {"tool_mode": "tool"})
    with pytest.raises(ConfigError, match=r"data.env_kwargs.tool_parser='bogus': choose one of auto, template"):
        make_env("corridor", {"tool_mode": "tools", "tool_parser": "bogus"})
    with pytest.raises(ConfigError, match=r"tool_mode=tools: PlannerActorTextWorld has no tools mode"):
        make_env("textworld-team", {"tool_mode": "tools"})
