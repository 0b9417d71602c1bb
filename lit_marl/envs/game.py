"""A stateful game (a registered ``Env``: TextWorld, Corridor, ...) played inside joint rollout
trees: what no stateless environment can give MAGRPO.

Each tree node holds a game state. Each joint action of a node steps its own copy of that state
(``clone()``, or ``replay``: a fresh game that replays the branch's commands), and the child node
continues from that copy, so sibling branches never see each other's moves. The game's outcome
(``won``, ``score``, ``max_score``) gives the rewards by the episodes' ``reward_density`` rule
(``returns.step_reward``); a joint action that ends the game opens no child. Generation is as for
every tree: one batched generate per agent per turn over all open nodes.

    data:
      class_path: lit_marl.data.RolloutDataModule
      init_args:
        env: {class_path: lit_marl.envs.game.GameEnv, init_args: {name: textworld, reward_density: dense}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lit_marl import ConfigError
from lit_marl.envs import make_env
from lit_marl.envs.base import Env, JointEnv, StepResult
from lit_marl.envs.sources import resolve_source
from lit_marl.returns import step_reward
from lit_marl.tasks import load_tasks


@dataclass
class GameState:
    """A node's game: the environment instance, its commands so far and its score."""

    env: Env
    task: dict
    played: list[list[str]]
    score: float = 0.0


class GameEnv(JointEnv):
    """A registered stateful ``Env`` (TextWorld, Corridor, ...) played inside joint rollout trees, a game per node."""

    stateful = True

    def __init__(
        self,
        name: str,
        kwargs: dict | None = None,
        reward_density: Literal["sparse", "dense"] = "sparse",
        score_weight: float | None = None,
        branch: Literal["clone", "replay"] = "clone",
    ):
        """
        Args:
            name: A registered stateful environment (``textworld``, ``corridor``, ...).
            kwargs: Its constructor's keyword arguments.
            reward_density: ``sparse``: the outcome on the step that ends a branch; ``dense``: score
                deltas each step plus the outcome (``returns.step_reward``).
            score_weight: Weight of the score in the reward (default: 0 sparse, 0.5 dense; < 1).
            branch: How a joint action gets its own game: ``clone`` copies the node's state (the
                env's ``clone()``); ``replay`` starts the game again and replays the branch's commands.
        """
        self.name, self.kwargs = name, dict(kwargs or {})
        self.reward_density, self.score_weight, self.branch = reward_density, score_weight, branch
        step_reward(0, 0, 1, False, True, reward_density, score_weight)  # checks the two settings
        probe = self.make()
        if branch == "clone" and not probe.cloneable:
            raise ConfigError(
                f"data.env.branch=clone: the {name!r} environment cannot copy its state; set data.env.branch=replay"
            )
        self._num_agents = probe.num_agents

    def make(self) -> Env:
        return make_env(self.name, self.kwargs, "data.env.name")

    @property
    def num_agents(self) -> int:
        return self._num_agents

    @property
    def has_transition(self) -> bool:
        return True  # the game itself gives every child's observations

    def load_tasks(self, source: str, field: str) -> list[dict]:
        """A task file, or a named TextWorld game set ``textworld:<complexity>:<split>:<count>``
        (generated once, cached: ``envs.textworld.games.resolve_source``)."""
        return load_tasks(resolve_source(source, field), field, set(), needed_by=f"the {self.name!r} environment")

    def prompts(self, task: dict) -> list[str]:
        return self.start(task)[1]

    def start(self, task: dict) -> tuple[GameState, list[str]]:
        """A fresh game of ``task`` and each agent's first observation."""
        env = self.make()
        return GameState(env, task, []), env.reset(task)

    def step(self, state: GameState, actions: list[str]) -> tuple[GameState, StepResult]:
        """One joint action on its own copy of ``state``: the child's state and the step's result."""
        if self.branch == "clone":
            env = state.env.clone()
        else:
            env = self.make()
            env.reset(state.task)
            for earlier in state.played:
                env.step(earlier)
        result = env.step(actions)
        return GameState(env, state.task, state.played + [list(actions)], float(result.info.get("score", 0))), result

    def reward_of(self, state: GameState, child: GameState, result: StepResult, ends: bool) -> float:
        info = result.info
        return step_reward(
            state.score,
            child.score,
            float(info.get("max_score", 1) or 1),
            bool(info.get("won", False)),
            ends,
            self.reward_density,
            self.score_weight,
        )

    def reward(self, agent_completions, tasks):
        raise TypeError("GameEnv rewards come from the game's own outcome (build_tree steps it), not a reward call")
