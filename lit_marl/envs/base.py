"""ONE environment protocol, batched over states, that both rollouts drive.

``reset(tasks) -> states`` (each state's ``observations``: every agent's next prompt);
``step(states, joint actions, turn) -> Steps``: ONE call per turn over every open tree node or live
episode (a text environment's reward stays one batched call, its transition another inside it; a
game steps its instances in parallel); ``branch(state)``: an independent copy to step on (free for
text, a clone or a replay for games); ``load_tasks(source)``: named task sets belong to their
environment. A tree node holds a state and each joint action steps a branch of it, so MAGRPO trees
run over text histories and over games alike, and every environment plays as episodes.

Two kinds implement it: text environments (``TextEnv``: prompts + a reward function + an optional
transition, CoMLRL's pair; ``FunctionEnv``, ``envs.code.CodeEnv``, centralized, learned) and games
(``envs.game.Game``: TextWorld, ALFWorld, SWE, Corridor).
"""

from __future__ import annotations

import functools
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from lit_marl import ConfigError
from lit_marl.envs.calls import CallSettings, call_reward, call_transitions
from lit_marl.envs.formatters import Formatter, RewardCall
from lit_marl.tasks import load_tasks


@dataclass
class Steps:
    """What one ``step`` over many states gives, in the states' order."""

    observations: list[list[str] | None]
    """Each state's next observation per agent; None where it does not go on."""
    done: list[bool]
    """The state does not go on: the game ended, or a text environment's dialogue did (its last
    turn, no transition, or the caller's ``keep`` rule stopped it)."""
    truncated: list[bool]
    """Of the done ones: cut by a limit (a game's own step limit, the rollout's turn budget), not
    ended by the task."""
    infos: list[dict]
    """``won``, ``lost``, ``score`` (cumulative) and ``max_score`` of each state (a game's own; a text
    environment: ``won`` where its reward reports ``success`` 1, the running mean reward as score)."""
    rewards: torch.Tensor | None = None
    """``[states, agents]``: each joint action's reward: a text environment's reward function (NaN
    where a skipped reward failed), a game's outcome by its ``RewardRule``."""
    success: torch.Tensor | None = None
    """``[states]``: whether each joint action succeeded (the reward's ``success``, a game's ``won``),
    None where nothing says."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The means of what the reward reported over the turn's joint actions."""
    turn_metrics: dict[str, float] = field(default_factory=dict)
    """What the transition reported (e.g. how often an expert's reply was malformed)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the step's time went (a text env: ``reward_s``, ``transition_s``; a game: ``env_s``)."""


@dataclass
class Ended:
    """A state the rollout ended (a turn or context budget): its final ``info`` and the reward of
    its last turn per agent, as the turn that ended the episode."""

    info: dict
    rewards: list[float]


class Env(ABC):
    """The protocol. ``pool``: the threads a game steps its instances with (set by the data module)."""

    pool: ThreadPoolExecutor | None = None
    task_sets: tuple[str, ...] = ()
    """The heads of the named task sets ``load_tasks`` knows (``textworld`` for
    ``textworld:<complexity>:<split>:<count>``)."""
    demo_packages: tuple[str, ...] = ()
    """Packages whose versions key the cached walkthrough demonstrations of a named set."""
    tools: tuple = ()
    """The tools the agents may call (``lit_marl.tools.Tool``): the rollout renders them in each agent's
    own format, hands ``step`` each reply parsed into calls (``ParsedReply``) instead of its text, and
    renders the results an observation carries (``ToolResults``) as tool messages."""
    tool_parser: str = "auto"
    """How replies are read (``lit_marl.tools.formats.tool_format``): ``auto`` or a parser's name."""

    @property
    @abstractmethod
    def num_agents(self) -> int: ...

    @property
    def multi_turn(self) -> bool:
        """Whether a state can go on after a turn."""
        return True

    def load_tasks(self, source: str, field: str) -> list[dict]:
        """Task rows of ``source``: a file path by default; an environment may know named sets."""
        return load_tasks(source, field, self.required_fields())

    def required_fields(self) -> set[str]:
        return set()

    @abstractmethod
    def reset(self, tasks: list[dict]) -> list:
        """One fresh state per task; each state's ``observations`` are the agents' first prompts."""

    @abstractmethod
    def step(self, states: list, actions: list[list[str]], turn: int, last: bool = False, keep=None) -> Steps:
        """Every state takes its joint action (``actions[s][agent]``) and moves on in place. ``last``:
        no state goes on after this turn. ``keep``: ``[states, agents]`` rewards -> ``[states]`` bools,
        the caller's rule for which states go on (early termination), where the environment can
        skip work for the others (a text environment's transition; a game observes anyway)."""

    @abstractmethod
    def branch(self, state):
        """An independent copy of ``state`` to step on."""

    def anchor_keys(self, states: list) -> list[str | None]:
        """A canonical key of each state (``Game.state_key``), None where the env has none."""
        return [None] * len(states)

    def end(self, states: list) -> list[Ended | None]:
        """The rollout ended these states (a turn or context budget): each one's final ``info`` and
        last turn's rewards where ending changes them (an env that scores on ``submit`` scores now,
        a sparse game pays its outcome), else None."""
        return [None] * len(states)

    def release(self, states: list) -> None:
        """Free what the states hold (workspaces, processes); called once a rollout is over."""
        return None

    def demonstration(self, task: dict) -> list[list[dict]]:
        """An expert trajectory of ``task`` for SFT: one chat per agent, the env's prompts as user
        messages and the expert's replies as assistant messages (``lit_marl/rollout/demos.py``;
        ``scripts/make_demos.py`` writes them). Environments that have an expert implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no expert: it cannot yield demonstrations")


@dataclass
class TextState:
    """A text environment's state: the task and each agent's dialogue so far."""

    task: dict
    prompts: list[list[str]]
    """Per agent, each turn's prompt: the first formatted, then what the transition returned
    (CoMLRL's ``prompt_history_per_agent``)."""
    responses: list[list[str]]
    """Per agent, its responses of the turns played."""
    observations: list[str]
    """Per agent, the text it reads this turn (its latest prompt, formatted unless passed through)."""
    score: float = 0.0
    """The running sum of the team's mean reward."""


class TextEnv(Env):
    """Prompts per task, a reward over joint actions, and (multi-turn) a transition that builds each
    branch's next prompts from its histories; stateless, so a branch is a copy of its histories.
    ``call_settings``: how the reward and transition are called (set by the data module)."""

    call_settings: CallSettings = CallSettings()

    @abstractmethod
    def prompts(self, task: dict) -> list[str]:
        """reset: each agent's first prompt for ``task``."""

    @abstractmethod
    def reward(
        self, agent_completions: list[list[str]], tasks: list[dict]
    ) -> Sequence[float] | Mapping[str, Sequence[float]]:
        """step, scoring part: ``agent_completions[agent][j]`` is joint action j on ``tasks[j]``.
        One float per joint action, one list per joint action (per agent), or a mapping with key
        ``reward`` and further per-joint-action metrics."""

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
        """step, observation part, batched over branches: every argument is a list with one entry
        per branch (its task row, the task's prompt text - the row's ``data.reward_calls.transition_prompt_field``,
        "" where it has none -, this turn's completions, the histories, each agent's first prompt
        first); returns each branch's next prompt per agent."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no transition")

    def transition_metrics(self) -> dict[str, float]:
        """Metrics of the last ``transition`` call (e.g. how often an expert's reply was malformed),
        logged per turn as ``turn_<t>/<name>``; none by default."""
        return {}

    @property
    def has_transition(self) -> bool:
        return type(self).transition is not TextEnv.transition

    @property
    def transition_name(self) -> str:
        """How errors name the transition."""
        return type(self).transition.__qualname__

    @property
    def reward_name(self) -> str:
        """How errors name the reward."""
        return type(self).reward.__qualname__

    @property
    def multi_turn(self) -> bool:
        return self.has_transition

    # ------------------------------------------------------------------ the protocol over text states
    def reset(self, tasks: list[dict]) -> list[TextState]:
        n = self.num_agents
        states = []
        for task in tasks:
            first = self.prompts(task)
            states.append(TextState(task, [[p] for p in first], [[] for _ in range(n)], list(first)))
        return states

    def branch(self, state: TextState) -> TextState:
        prompts, responses = [list(h) for h in state.prompts], [list(h) for h in state.responses]
        return TextState(state.task, prompts, responses, list(state.observations), state.score)

    def observe(self, task: dict, prompts: list[str]) -> list[str]:
        """What each agent reads after a transition returned ``prompts`` for ``task``: the prompts as
        they are (an environment with formatters formats them: ``FunctionEnv``)."""
        return list(prompts)

    def step(self, states, actions, turn, last=False, keep=None) -> Steps:
        """ONE reward call over every joint action, then ONE transition call over the states that go on."""
        calls, n = self.call_settings, self.num_agents
        start = time.perf_counter()
        samples: dict[str, torch.Tensor] = {}
        rewards, metrics = call_reward(
            self.reward,
            [[a[i] for a in actions] for i in range(n)],
            [s.task for s in states],
            turn,
            calls.on_reward_error,
            calls.reward_timeout_s,
            samples,
        )
        if rewards.dim() == 1:  # a joint reward is every agent's reward
            rewards = rewards.unsqueeze(1).expand(-1, n)
        for state, joint, reward in zip(states, actions, rewards):
            for history, action in zip(state.responses, joint):
                history.append(action)
            state.score += float(torch.nan_to_num(reward).mean())
        scored = time.perf_counter()
        going = torch.full((len(states),), not last and self.has_transition)
        if keep is not None and bool(going.any()):
            going &= keep(rewards)
        moving = [s for s, g in zip(states, going.tolist()) if g]
        prompts = call_transitions(self, moving, turn, calls.transition_prompt_field, calls.transition_timeout_s)
        for state, next_prompts in zip(moving, prompts):
            for history, prompt in zip(state.prompts, next_prompts):
                history.append(prompt)
            state.observations = self.observe(state.task, next_prompts)
        success = samples.get("success")
        won = [False] * len(states) if success is None else (success == 1).tolist()
        done = (~going).tolist()
        return Steps(
            observations=[s.observations if g else None for s, g in zip(states, going.tolist())],
            done=done,
            truncated=[d and self.has_transition for d in done],
            infos=[{"won": w, "lost": False, "score": s.score, "max_score": 1.0} for s, w in zip(states, won)],
            rewards=rewards,
            success=success,
            metrics=metrics,
            turn_metrics=self.transition_metrics() if moving else {},
            seconds={"reward_s": scored - start, "transition_s": time.perf_counter() - scored},
        )


class FunctionEnv(TextEnv):
    """Formatters (one per agent: format strings or functions of the task row) + a reward function
    (+ an external transition): ``envs/formatters.py``. ``passthrough``: a transition's prompts are
    read as they are; otherwise each becomes the row's ``call_settings.transition_prompt_field`` (the
    field the transition receives as ``prompt``) and is formatted again."""

    passthrough: bool = False

    def __init__(
        self,
        agent_prompts: list,
        reward_fn,
        transition=None,
        transition_kwargs: dict | None = None,
        batched_transition: bool = False,
    ):
        self.formatters = [Formatter(p, f"data.agent_prompts[{i}]") for i, p in enumerate(agent_prompts)]
        self.reward_fn = reward_fn
        self.batched_transition = batched_transition
        self.transition_fn = None
        self._fields = set().union(*(f.fields for f in self.formatters))
        if transition is not None:
            try:
                inspect.signature(transition).bind_partial(**(transition_kwargs or {}))
            except TypeError as err:
                name = getattr(transition, "__qualname__", repr(transition))
                raise ConfigError(f"data.transition_kwargs={transition_kwargs!r} do not fit {name}: {err}") from err
            self.transition_fn = functools.partial(transition, **(transition_kwargs or {}))

    @property
    def num_agents(self) -> int:
        return len(self.formatters)

    @property
    def reward_fn(self):
        """The user's reward function (setting it sets how it is called: ``RewardCall``)."""
        return self.reward_call.function

    @reward_fn.setter
    def reward_fn(self, function) -> None:
        self.reward_call = RewardCall(function, self.num_agents)

    def required_fields(self) -> set[str]:
        return self._fields

    def prompts(self, task: dict) -> list[str]:
        return [f(task) for f in self.formatters]

    def observe(self, task: dict, prompts: list[str]) -> list[str]:
        if self.passthrough:
            return list(prompts)
        field = self.call_settings.transition_prompt_field
        return [f({**task, field: p}, external=p) for f, p in zip(self.formatters, prompts)]

    def check_formatters(self) -> None:
        """A format string that never reads the prompt field would drop the transition's prompts."""
        field = self.call_settings.transition_prompt_field
        for i, f in enumerate(self.formatters):
            if not self.passthrough and not f.uses(field):
                raise ConfigError(
                    f"data.agent_prompts[{i}]={f.template!r} does not use {{{field}}}: after the first "
                    f"turn the transition's prompt becomes the row's {field!r} field and goes through the "
                    f"formatter, which would drop it. Put {{{field}}} where it goes, or set "
                    "data.external_prompt_passthrough: true to read the transition's prompts as they are"
                )

    def reward(self, agent_completions, tasks):
        return self.reward_call(agent_completions, tasks)

    @property
    def has_transition(self) -> bool:
        return self.transition_fn is not None

    @property
    def transition_name(self) -> str:
        return getattr(self.transition_fn.func, "__qualname__", repr(self.transition_fn.func))

    @property
    def reward_name(self) -> str:
        """The user's function, ``module:name`` (what ``data.reward_fn`` names)."""
        fn = getattr(self.reward_fn, "func", self.reward_fn)
        qualname = getattr(fn, "__qualname__", repr(fn))
        module = getattr(fn, "__module__", None)
        return f"{module}:{qualname}" if module else qualname

    def transition(self, *, task, num_agents, **branches):
        """CoMLRL's transition interface has no ``task``: called once per branch, or once for all
        branches when it is ``batched_transition``."""
        if self.batched_transition:
            return self.transition_fn(num_agents=num_agents, **branches)
        return [
            self.transition_fn(num_agents=num_agents, **{key: values[b] for key, values in branches.items()})
            for b in range(len(task))
        ]


REGISTRY: dict[str, type[Env]] = {}


def register(name: str):
    """Class decorator: make an environment selectable by ``name`` in YAML (``data.env: name``)."""

    def add(cls: type[Env]) -> type[Env]:
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"environment name {name!r} is taken by {REGISTRY[name].__qualname__}")
        REGISTRY[name] = cls
        return cls

    return add
