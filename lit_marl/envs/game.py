"""Games: stateful environments (TextWorld, ALFWorld, SWE, Corridor) behind the one protocol.

A game class describes ONE game: ``start(task)`` gives each agent its first observation,
``act(actions)`` (one text per agent) plays a turn. The protocol runs over states that each hold
their own game, spawned from the configured one's constructor arguments: ``reset`` starts one per
task, ``step`` plays every state's turn (in the data module's thread pool), ``branch`` gives a joint
action its own copy (``clone()``, or a fresh game that replays the branch's commands), so a MAGRPO
tree node holds a game and sibling branches never see each other's moves. ``step`` returns each
turn's reward, made from the outcome (``won``, ``score``, ``max_score``) by the game's ``RewardRule``
(``data.reward_density`` and ``data.score_weight``, handed over by the data module), so every game is
scored the same way and no caller writes the rule again.

A game of your own is one file: subclass ``Game``, implement ``start`` and ``act`` (and
``load_tasks`` for named task sets of your own), then name it in YAML by its import path
(``data.env: my_package.games:MyGame``) or register it (``@register("name")``).
"""

from __future__ import annotations

import copy
import time
import typing
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.envs.base import Ended, Env, Steps
from lit_marl.envs.commands import expert_replies, play_calls
from lit_marl.envs.sources import family, named_set
from lit_marl.returns import step_reward
from lit_marl.tasks import load_tasks
from lit_marl.tools.calls import ToolResults
from lit_marl.tools.formats import ParserName


def observation_messages(observation) -> list[dict]:
    """An observation as chat messages in no model's format yet: a user message, or one ``tool``
    message per tool result (an agent renders them in its own: ``Agent.observation_messages``)."""
    if isinstance(observation, ToolResults):
        return [{"role": "tool", "name": r.call.name, "content": r.text} for r in observation.results]
    return [{"role": "user", "content": observation}]


@dataclass
class StepResult:
    """One game's turn."""

    observations: list[str]
    """The next observation of each agent."""
    terminated: bool = False
    """The episode ended inside the environment (won or lost)."""
    truncated: bool = False
    """The environment cut the episode short (its own step limit)."""
    info: dict = field(default_factory=dict)
    """``won``, ``lost``, ``score`` (cumulative) and ``max_score`` at least."""


@dataclass(frozen=True)
class RewardRule:
    """How a game's outcome becomes each turn's reward (``returns.step_reward``): ``sparse`` pays the
    outcome on the turn that ends the episode, ``dense`` each turn's score delta and the win."""

    density: Literal["sparse", "dense"] = "sparse"
    score_weight: float | None = None

    def __post_init__(self):
        step_reward(0, 0, 1, False, True, self.density, self.score_weight)  # checks the two settings

    def __call__(self, state: "GameState", ends: bool) -> float:
        """The reward of ``state``'s latest turn; ``ends``: the episode ended on it."""
        info = state.info
        max_score = float(info.get("max_score", 1) or 1)
        won = bool(info.get("won", False))
        return step_reward(state.previous_score, state.score, max_score, won, ends, self.density, self.score_weight)


@dataclass
class GameState:
    """A state of the protocol: its own game, the task, the commands played so far, the latest
    observations and outcome."""

    game: "Game"
    task: dict
    observations: list[str]
    played: list[list[str]] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    previous_score: float = 0.0
    """The score before the latest turn (what a dense reward's delta starts from)."""

    @property
    def score(self) -> float:
        return float(self.info.get("score", 0.0))


class Game(Env):
    """One game, and the protocol over states that each hold one."""

    num_agents: int = 1
    cloneable: bool = False
    """Whether ``clone()`` gives an independent copy (for branching a tree mid-episode)."""
    branching: Literal["clone", "replay"] | None = None
    """How ``branch`` copies a state: ``clone`` (the game's ``clone()``), ``replay`` (a fresh game
    replaying the branch's commands); None: clone where the game can, else replay."""
    reward_rule: RewardRule = RewardRule()
    """How the outcome becomes rewards (set by the data module from ``data.reward_density``)."""
    commands: tuple = ()
    """The game's actions as tools (``lit_marl.envs.commands.Command``), offered in ``tool_mode:
    tools``: a call writes the command a text-mode reply would be."""

    def __new__(cls, *args, **kwargs):
        game = super().__new__(cls)
        game._settings = (args, kwargs)  # what ``spawn`` builds each state's game from
        return game

    def spawn(self) -> "Game":
        """A fresh game with this one's settings."""
        args, kwargs = self._settings
        return type(self)(*args, **kwargs)

    # ------------------------------------------------------------------ one game
    @abstractmethod
    def start(self, task: dict) -> list[str]:
        """Start ``task``; each agent's first observation."""

    @abstractmethod
    def act(self, actions: list[str]) -> StepResult:
        """One turn: each agent's action text."""

    def use_tool_mode(self, tool_mode: str, tool_parser: str = "auto", tools: tuple = ()) -> None:
        """``tools``: the game's actions (``commands``, or ``tools`` for a game that runs its own calls)
        become the agent's tools, its replies read in ``tool_parser``'s format (``play``); ``text``:
        commands as plain text."""
        if tool_mode not in ("text", "tools"):
            raise ConfigError(
                f"data.env_kwargs.tool_mode={tool_mode!r}: choose text (commands as plain text) or tools (the game's "
                "actions as tools in the model's own format)"
            )
        if tool_mode == "tools":
            if tool_parser not in typing.get_args(ParserName):
                names = ", ".join(typing.get_args(ParserName))
                raise ConfigError(f"data.env_kwargs.tool_parser={tool_parser!r}: choose one of {names}")
            tools = tools or tuple(c.tool for c in self.commands)
            if not tools or self.num_agents != 1:
                raise ConfigError(
                    f"data.env_kwargs.tool_mode=tools: {type(self).__name__} has no tools mode (it is offered by "
                    "one-agent games that declare their actions as tools); use tool_mode: text"
                )
            self.tools, self.tool_parser = tuple(tools), tool_parser

    def play(self, actions: list) -> StepResult:
        """One turn from the agents' replies: as they are (text mode, or a game that reads its own
        tool calls), or, in tools mode, the reply's call written as its command
        (``commands.play_calls``)."""
        if not (self.tools and self.commands):
            return self.act(actions)
        observation, played, counts = play_calls(self, actions[0], getattr(self, "_tool_counts", None))
        self._tool_counts = counts  # replaced, never changed in place: a shallow clone keeps its own
        if played is None:  # nothing played: the outcome as it stands
            return StepResult([observation], info={**self.outcome(), "counts": counts})
        info = {**played.info, "counts": counts}
        return StepResult([observation], terminated=played.terminated, truncated=played.truncated, info=info)

    def outcome(self) -> dict:
        """The outcome as it stands (``won``, ``lost``, ``score``, ``max_score``): what a tools-mode turn
        that played nothing reports. A game with a score says its own; by default nothing is scored yet."""
        return {"won": False, "lost": False, "score": 0, "max_score": 1}

    def expert_replies(self, task: dict) -> list[list[str]]:
        """The expert's turns as the agent would write them: its commands, or in tools mode the tool
        calls that write them."""
        turns = self.expert_turns(task)
        return expert_replies(self, turns) if self.tools and self.commands else turns

    def state_key(self) -> str | None:
        """A canonical key of the current state: equal for equal states whatever led to them (the
        anchor of step-level groups, ``docs/credit.md``), or None when the game has none (the anchor
        is then the agent's observation text). Any function of the episode's history so far keeps
        the step-level estimate unbiased; a finer key groups less, a coarser one more."""
        return None

    def finish(self) -> dict | None:
        """The rollout ended the episode (its turn or context budget ran out): the final ``info``
        when ending changes it (a game that scores on ``submit`` scores now), else None."""
        return None

    def close(self) -> None:
        """Release what the game holds (a workspace, a process); called once it is over, also when
        it raised. Nothing by default."""
        return None

    def clone(self) -> "Game":
        if not self.cloneable:
            raise TypeError(f"{type(self).__name__} cannot be cloned: replay the action prefix instead")
        return copy.deepcopy(self)

    def expert_turns(self, task: dict) -> list[list[str]]:
        """The expert's play of ``task``: per turn, one action text per agent (an optimal solver, a
        game's walkthrough, a recorded fix). Games that have an expert implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no expert: it cannot yield demonstrations")

    def demonstration(self, task: dict) -> list[list[dict]]:
        """The expert's episode, played in a fresh game, as one chat per agent: the observations as
        user messages (tool results as ``tool`` messages), the actions as assistant messages - the
        turns an RL episode renders. An expert that does not win is an error, never a demonstration."""
        game = self.spawn()
        try:
            observations, turns = game.start(task), game.expert_replies(task)
            chats: list[list[dict]] = [[] for _ in range(game.num_agents)]
            for t, actions in enumerate(turns):
                for chat, observation, action in zip(chats, observations, actions):
                    chat += [*observation_messages(observation), {"role": "assistant", "content": action}]
                result = game.play(actions)
                if result.terminated or result.truncated:
                    if not result.info.get("won") or t != len(turns) - 1:
                        raise ValueError(f"task {task!r}: the expert's play ended at turn {t + 1} without a win")
                    return chats
                observations = result.observations
            raise ValueError(f"task {task!r}: the expert's {len(turns)} turns did not finish the episode")
        finally:
            game.close()

    # ------------------------------------------------------------------ the protocol over states
    @staticmethod
    def resolve_set(source: str, field: str) -> str:
        """The task file of a named set of this game (``task_sets``), generated once and cached."""
        raise NotImplementedError("a game with task_sets resolves them")

    def load_tasks(self, source: str, field: str) -> list[dict]:
        """A task file, or one of this game's named sets (``task_sets``)."""
        if family(source, self):
            source = named_set(source, field, self.resolve_set)
        return load_tasks(source, field, set(), needed_by=f"the {type(self).__name__} environment")

    def _map(self, fn, items: list) -> list:
        return list(self.pool.map(fn, items)) if self.pool is not None and len(items) > 1 else [fn(x) for x in items]

    def reset(self, tasks: list[dict]) -> list[GameState]:
        games = [self.spawn() for _ in tasks]
        firsts = self._map(lambda pair: pair[0].start(pair[1]), list(zip(games, tasks)))
        return [GameState(game, task, first) for game, task, first in zip(games, tasks, firsts)]

    def step(self, states, actions, turn, last=False, keep=None) -> Steps:
        """Every state's game plays its joint action (in parallel); ``keep`` is not needed: a game
        observes every state anyway."""
        start = time.perf_counter()
        results: list[StepResult] = self._map(lambda pair: pair[0].game.play(pair[1]), list(zip(states, actions)))
        for state, joint, result in zip(states, actions, results):
            state.played.append(list(joint))
            state.previous_score = state.score
            state.observations, state.info = result.observations, result.info
        done = [bool(r.terminated or r.truncated) for r in results]
        rewards = [self.reward_rule(state, d or last) for state, d in zip(states, done)]
        outcomes = {key: sum(bool(r.info.get(key, False)) for r in results) / len(results) for key in ("won", "lost")}
        return Steps(
            observations=[None if d else r.observations for r, d in zip(results, done)],
            done=done,
            truncated=[bool(r.truncated and not r.terminated) for r in results],
            infos=[r.info for r in results],
            rewards=torch.tensor(rewards, dtype=torch.float32).unsqueeze(1).expand(-1, self.num_agents),
            success=torch.tensor([float(bool(r.info.get("won", False))) for r in results]),
            metrics=outcomes,
            seconds={"env_s": time.perf_counter() - start},
        )

    def branch(self, state: GameState) -> GameState:
        how = self.branching or ("clone" if self.cloneable else "replay")
        if how == "clone":
            game = state.game.clone()
        elif how == "replay":
            game = self.spawn()
            game.start(state.task)
            for earlier in state.played:
                game.play(earlier)
        else:
            raise ConfigError(f"{type(self).__name__}.branching={how!r}: choose clone or replay")
        return GameState(game, state.task, list(state.observations), [list(p) for p in state.played], dict(state.info))

    def anchor_keys(self, states: list[GameState]) -> list[str | None]:
        return [state.game.state_key() for state in states]

    def end(self, states: list[GameState]) -> list[Ended | None]:
        """The final info (a game that scores on ``submit`` scores now) and the reward of the last
        turn as the turn that ended the episode (sparse rewards pay the outcome there)."""
        finals = self._map(lambda state: state.game.finish(), states)
        ended = []
        for state, info in zip(states, finals):
            if info is not None:
                state.info = info
            ended.append(Ended(state.info, [self.reward_rule(state, True)] * self.num_agents))
        return ended

    def release(self, states: list[GameState]) -> None:
        for state in states:
            state.game.close()
