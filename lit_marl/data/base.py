"""The data modules' common part: task rows in batches, the environment and the engine, the one
handshake with the training module each step, the held-out evaluation. ``trees.py`` and
``episodes.py`` turn each batch into rollouts right before the training step: Lightning calls
``on_after_batch_transfer`` after the previous update, so every rollout comes from the current
weights (the loader's prefetch only touches task rows)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, NamedTuple

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_marl import ConfigError
from lit_marl.agents import Team, give_tools
from lit_marl.data.ahead import RolloutsAhead
from lit_marl.envs import make_env
from lit_marl.envs.base import Env, FunctionEnv, TextEnv
from lit_marl.envs.calls import CallSettings
from lit_marl.envs.game import Game, RewardRule
from lit_marl.envs.sources import resolve_demo_source
from lit_marl.fields import NonNegativeInt, PositiveInt, UnitIntervalRightOpen, as_group, check_fields, saved_groups
from lit_marl.generation import Sampling, make_engine
from lit_marl.metrics import EvalMeans, PassAtK
from lit_marl.rollout.demos import DemoSamples, DemoSettings, load_demos, render_demos
from lit_marl.rollout.settings import RolloutSettings
from lit_marl.tasks import TaskLoader, import_object, task_loader


class Evaluated(NamedTuple):
    """What evaluating one batch of held-out tasks gives."""

    metrics: dict[str, float | tuple[float, int]]
    """metric -> mean (or (mean, tasks) of a subset, e.g. one task type)"""
    successes: tuple[torch.Tensor, torch.Tensor] | None
    """per task its samples and how many of them succeeded, ([tasks], [tasks]); None: nothing says"""
    examples: list[dict] | tuple = ()
    """per task (greedy only) its final joint answer: ``{"task", "lines" (one per agent), "reward"}``"""


def build_engine(name: str, options: dict | None):
    """The generation engine named by ``data.engine`` (a bad name or a missing vLLM fails here)."""
    try:
        return make_engine(name, options)
    except (ValueError, ImportError) as error:
        raise ConfigError(str(error)) from error


class TaskDataModule(L.LightningDataModule):
    """Task rows in batches; subclasses turn each batch into rollouts (trees or episodes) right
    before the training step. Configs name the subclass: ``data: {class_path: ..., init_args: ...}``.
    These settings are every data module's:

    Args:
        train_path: Task rows for training (JSONL/JSON/CSV/Parquet), read with ``datasets``, or a source the
            environment knows (``humaneval[:130]`` for the code environment; a named game set such as
            ``textworld:<complexity>:<split>:<count>``, ``alfworld:<split>:<count per task type>``,
            ``alfworld-data:<split>[:<count>]``, ``swe:bundled:<split>``: generated once, cached).
        env: The environment: an object (``class_path`` + ``init_args``, e.g. ``lit_marl.envs.code.CodeEnv``),
            or a registered name (``corridor``, ``textworld``, ``textworld-team``, ``alfworld``, ``swe``) or the
            import path of an ``Env`` of your own (``my_package.games:MyGame``), built with ``env_kwargs``. It
            gives the prompts, the rewards and the next turn's; replaces ``agent_prompts``, ``reward_fn`` and
            ``transition`` (which build a text environment).
        env_kwargs: Keyword arguments of ``env`` when it is a name.
        agent_prompts: One formatter per agent (CoMLRL's formatters): a format string filled from a task row's
            fields (``{topic}``), a function of the row returning the prompt text (Python), or
            ``{formatter: package.module:function}``; the number of entries is the number of agents. With
            ``reward_fn``; not with ``env``.
        reward_fn: The joint reward function (an import path ``module:function``, or the function), called once
            per turn over every joint action: with ``agent_completions=[agent][joint action]`` and
            ``tasks=[joint action]`` when it takes ``agent_completions``, otherwise as CoMLRL calls it (one list
            of completions per agent as positional arguments, ``batch_items`` the task rows if it takes them).
        transition: The external transition (an import path, or the function) that builds each branch's next
            prompts from its histories (needed for more than one turn), e.g.
            ``lit_marl.rollout.transitions:plain``.
        transition_kwargs: Extra keyword arguments bound to the transition.
        batched_transition: Call the transition once per turn with every keyword argument a list over all
            branches (it returns one prompt list per branch); otherwise once per branch (CoMLRL's interface).
        val_path: Held-out task rows for validation, test and the before/after evaluation.
        tasks_per_step: Tasks per training step (tree roots, or episode starts).
        num_generations: Samples G per group: the responses each agent samples at every tree node, or the
            episodes per task from the same start (GRPO/RLOO groups; 1 for PPO).
        sampling: How each reply is sampled, one group every engine reads (``generation.Sampling``):
            ``max_new_tokens`` (the budget of a reply), ``temperature``, ``top_p``, ``top_k`` (null or 0:
            off) of training rollouts; evaluation decodes greedily with the same budget.
        eval_tasks_per_step: Tasks per batch in validation/test (greedy, one response each).
        seed: Seed of the task order.
        engine: What generates: ``auto`` (default: the lean ``torch`` decoder for Llama/Qwen2 models,
            transformers' ``generate`` for the rest), ``torch``, ``hf``, ``vllm`` (GPU, installed separately;
            colocated, weights synced from the trainer before each rollout) or ``vllm_server`` (vLLM servers on
            GPUs of their own, started by the run or running; weights sent by vLLM's transfer protocol).
        engine_options: Settings of the engine: vllm's (e.g. ``gpu_memory_utilization``); vllm_server's
            (``generation.server.ServerSettings``: servers, tensor_parallel_size, transport, timeout_s...); for
            ``torch`` and ``auto``, ``kept_kv_gib`` (default 4): the KV cache kept between a rollout's turns (0:
            re-read each history).
        demos: The demonstrations of SFT (the ``SFT`` module, or the first phase of ``callbacks.PhaseSwitch``):
            their ``path`` (a JSONL file, or the walkthroughs of a named game set), ``batch_size`` and
            ``loss_on`` (``rollout.demos.DemoSettings``).
        reward_density: How a game's outcome becomes rewards: ``sparse``: the outcome (won) on the step that
            ends the episode; ``dense``: each turn's score delta (normalized by max_score), plus the outcome.
        score_weight: Weight of the normalized score (sparse: the final score; dense: the deltas), in [0, 1)
            so no lost episode outscores a won one; default 0 (sparse), 0.5 (dense).
        reward_calls: How a text environment's reward function and transition are called: what a failing
            reward does (``on_reward_error``), time limits, the transition's prompt field, how many
            all-skipped steps stop the run (``envs.calls.CallSettings``).
        max_staleness: Updates a training rollout's weights may lag behind: 0, generated with the weights
            it trains (on-policy); 1, step k+1's rollout generated while step k updates (``data/ahead.py``;
            engine vllm_server, model.update.rollout_is_cap weighing the one-update-old rows).
    """

    train_tasks: list[dict]
    val_tasks: list[dict]
    demos: list[dict] = []
    examples: list[dict] = []
    """The final joint answer of each held-out task of this rank's latest ``evaluate`` (greedy)."""
    demo_rows: int | None = None
    """How many demonstrations the coming SFT epoch may serve, counted from its start (``PhaseSwitch``
    sets it from the budget); None: whole passes."""

    def __init__(
        self,
        train_path: str,
        env: Env | str | None = None,
        env_kwargs: dict | None = None,
        agent_prompts: list[str | dict] | None = None,
        reward_fn: str | None = None,
        transition: str | None = None,
        transition_kwargs: dict | None = None,
        batched_transition: bool = False,
        val_path: str | None = None,
        tasks_per_step: PositiveInt = 4,
        num_generations: PositiveInt = 4,
        sampling: Sampling = Sampling(),
        eval_tasks_per_step: PositiveInt = 16,
        seed: int = 0,
        engine: str = "auto",
        engine_options: dict | None = None,
        demos: DemoSettings = DemoSettings(),
        reward_density: Literal["sparse", "dense"] = "sparse",
        score_weight: UnitIntervalRightOpen | None = None,
        reward_calls: CallSettings = CallSettings(),
        max_staleness: NonNegativeInt = 0,
    ):
        super().__init__()
        check_fields("data", TaskDataModule.__init__, locals())
        self.reward_rule = RewardRule(reward_density, score_weight)  # checks the two settings
        given = {"env": env, "reward_fn": reward_fn, "transition": transition}  # objects (Python API): not saved
        objects = [k for k, v in given.items() if not isinstance(v, (str, type(None)))]
        objects += ["agent_prompts"] if any(callable(p) for p in agent_prompts or []) else []
        self.save_hyperparameters(ignore=objects)
        self.engine = build_engine(engine, engine_options)
        if max_staleness > 1:
            raise ConfigError(f"data.max_staleness={max_staleness}: only 1 (one step ahead) is built; set 0 or 1")
        if max_staleness and not self.engine.remote:
            raise ConfigError(
                f"data.max_staleness={max_staleness}: data.engine={engine} generates with the trainer's devices "
                "and weights; use data.engine: vllm_server"
            )
        self.ahead = RolloutsAhead() if max_staleness else None
        text = (agent_prompts, reward_fn, transition, transition_kwargs, batched_transition)
        self.env = self.train_env = build_env(env, env_kwargs, *text)
        self.sampling, self.call_settings = as_group(Sampling, sampling), as_group(CallSettings, reward_calls)
        self.demo_settings = as_group(DemoSettings, demos)
        saved_groups(self, sampling=self.sampling, reward_calls=self.call_settings, demos=self.demo_settings)
        self.configure_envs(self.env)
        self._skipped_steps = 0
        env_name = env if isinstance(env, str) else type(self.env).__qualname__
        others = {"data.train_path": train_path, "data.val_path": val_path}  # demonstrations never from these games
        source = self.demo_settings.path
        self.load_demos(source and resolve_demo_source(source, self.env, env_name, env_kwargs, others))
        self.train_tasks = self.env.load_tasks(train_path, "data.train_path")
        self.val_tasks = self.env.load_tasks(val_path, "data.val_path") if val_path else []

    @property
    def num_agents(self) -> int:
        return self.env.num_agents

    def configure_envs(self, *envs: Env) -> None:
        """The settings the data module hands each of ``envs``: the reward-call settings to a text
        environment, the reward rule to a game."""
        for env in envs:
            if isinstance(env, TextEnv):
                env.call_settings = self.call_settings
            elif isinstance(env, Game):
                env.reward_rule = self.reward_rule

    def load_demos(self, demo_path: str | None) -> None:
        """The demonstrations of SFT (``SFT``, or the first phase of ``callbacks.PhaseSwitch``)."""
        self.demos = load_demos(demo_path, self.num_agents) if demo_path else []
        self._loaders: dict[str, tuple[object, TaskLoader]] = {}

    @property
    def phase(self) -> str:
        """``sft`` (demonstrations) or ``rl`` (rollouts): the phase of the team the module hands over."""
        trainer = self.trainer
        return trainer.lightning_module.team().phase if trainer is not None and trainer.lightning_module else "rl"

    def train_dataloader(self) -> TaskLoader:
        """The current phase's loader: demonstrations or tasks. Each is made once per fit and then
        handed back (Lightning asks again each epoch when phases can switch), so its epoch count and
        position carry on."""
        trainer, phase = self.trainer, self.phase
        cached = self._loaders.get(phase)
        if cached is None or cached[0] is not trainer:
            rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
            if phase == "sft":
                rows, size, name = self.demos, self.demo_settings.batch_size, "demos"
                if not rows:
                    raise ConfigError("the SFT phase needs demonstrations: set data.demos.path (scripts/make_demos.py)")
            else:
                rows, size, name = self.train_tasks, self.hparams.tasks_per_step, "tasks"
            loader = TaskLoader(rows, size, self.hparams.seed, rank, world, name)
            self._loaders[phase] = cached = (trainer, loader)
        self.train_loader = cached[1]
        self.train_loader.end_after(self.demo_rows if phase == "sft" else None)
        return self.train_loader

    def rl_demos(self, agents: list, draw: int) -> list[DemoSamples]:
        """Per agent, this rank's share of batch ``draw`` of the demonstrations an RL step also learns
        (``model.update.sft_coef``): ``data.demos.batch_size`` rows a rank, the batches walking
        through the demonstrations epoch after epoch in a seeded order (``TaskLoader.drawn``), rendered as
        the SFT phase renders them."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        walk = self._loaders.get("rl_demos")
        if walk is None or walk[0] is not trainer:
            loader = TaskLoader(self.demos, self.demo_settings.batch_size, self.hparams.seed, rank, world, "demos")
            self._loaders["rl_demos"] = walk = (trainer, loader)
        give_tools(agents, *self.agent_tools())  # the demonstrations' prompts show the rollouts' tools
        return render_demos(agents, walk[1].drawn(draw), self.demo_settings.loss_on)

    def agent_tools(self) -> tuple[tuple, str]:
        """The tools the agents may call and how their replies are read: the environment's."""
        return tuple(self.env.tools), self.env.tool_parser

    def on_after_batch_transfer(self, batch: list[dict], dataloader_idx: int):
        """Rows become what the training step consumes: rendered demonstrations in the SFT phase,
        rollouts of the current weights otherwise (greedy outside training)."""
        team = self.trainer.lightning_module.team()  # the one handshake of the step
        if self.trainer.training and team.phase == "sft":
            give_tools(team.agents, *self.agent_tools())  # the demonstrations' prompts show the rollouts' tools
            return render_demos(team.agents, batch, self.demo_settings.loss_on)
        if self.ahead is None or not self.trainer.training:
            with self.generating(team):
                return self.rollout_batch(team, batch, training=self.trainer.training)
        return self.rollout_ahead(team, batch)

    def rollout_ahead(self, team: Team, tasks: list[dict]):
        """This step's training rollout, generated during the last update where it could be, and the next
        step's started in the background with the weights this update starts from (``data/ahead.py``)."""

        def now():
            with self.generating(team):
                return self.rollout_batch(team, tasks, training=True)

        batch, stats = self.ahead.take(tasks, now)
        self.batch_stats(batch).update(stats)
        upcoming = self.train_loader.upcoming()
        if upcoming is not None:
            with self.generating(team):  # the current weights sent (every rank, in this thread)
                pass
        self.ahead.start(upcoming, lambda rows: self.rollout_batch(team, rows, training=True))
        return batch

    def batch_stats(self, batch) -> dict:
        """The stats a training step records of ``batch`` (a rollout's)."""
        raise NotImplementedError

    @contextmanager
    def generating(self, team: Team) -> Iterator[None]:
        """The block of a rollout or an evaluation by ``team``: its passes' context for this module's
        engine (precision; under FSDP only what the engine needs whole) and the engine's own (vLLM
        syncs every model first and sleeps after). A rollout generated ahead finishes first: the
        engine's weights change here."""
        if self.ahead is not None:
            self.ahead.settle()
        with team.computing(self.engine), self.engine.rollout(team.agents):
            yield

    def rollout_batch(self, team: Team, tasks: list[dict], training: bool):
        raise NotImplementedError

    @property
    def rollout_settings(self) -> RolloutSettings:
        """What this module's rollouts are (an algorithm checks it once in ``setup``)."""
        raise NotImplementedError

    def episodes(self, batch) -> float:
        """RL episodes in this rank's training batch (the unit of an RL budget)."""
        raise NotImplementedError

    def on_before_batch_transfer(self, batch: list[dict], dataloader_idx: int) -> list[dict]:
        if self.trainer is not None and self.trainer.training:
            self.train_loader.consumed += 1  # this batch now reaches the training step
            self.train_loader.epoch_length = int(min(self.trainer.num_training_batches, len(self.train_loader)))
        return batch

    def teardown(self, stage: str) -> None:
        if self.ahead is not None:  # a rollout in flight at the end: finished, never trained
            self.ahead.drop()
        self.engine.close()  # servers the run started stop with it (a later rollout starts them again)

    def val_dataloader(self) -> DataLoader:
        return task_loader(self.val_tasks, self.hparams.eval_tasks_per_step, False, self.hparams.seed)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def evaluation_metrics(self, agents, tasks: list[dict], num_samples: int = 1) -> Evaluated:
        """Means over one batch of held-out tasks, greedy (``num_samples`` 1) or ``num_samples``
        sampled per task; a metric of a subset of them (e.g. one task type) is ``(its mean, the
        subset's size)``; and per task its samples and those that succeeded (None where nothing says)."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, agents, num_samples: int = 1, pass_at_k: list[int] | tuple = ()) -> dict[str, float]:
        """Rollouts on all held-out tasks, greedy, or ``num_samples`` sampled per task (at the
        training temperature) with the unbiased ``pass@k`` of each k in ``pass_at_k``; each metric's
        mean over its tasks. With several ranks each rank plays every world-th task and the
        metrics (torchmetrics) sync: every rank returns the same values, having played its share.
        ``self.examples`` then holds this rank's tasks' final joint answers (``Evaluated.examples``)."""
        if not self.val_tasks:
            raise ConfigError("data.val_path: the held-out evaluation needs held-out tasks")
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        device = trainer.strategy.root_device if trainer is not None else "cpu"
        means, passes = EvalMeans(device), {k: PassAtK(k).to(device) for k in pass_at_k}
        mine = self.val_tasks[rank::world]
        self.examples = []
        for batch in task_loader(mine, self.hparams.eval_tasks_per_step, False, self.hparams.seed) if mine else []:
            metrics, successes, examples = Evaluated(*self.evaluation_metrics(agents, batch, num_samples))
            self.examples += examples
            for key, value in metrics.items():
                mean, count = value if isinstance(value, tuple) else (value, len(batch))
                means.update(key, mean, count)
            if passes and successes is None:
                raise ConfigError("HeldOutEvaluation.pass_at_k: this environment reports no success per sample")
            for metric in passes.values():
                metric.update(*successes)
        results = means.compute()
        results.update({f"pass@{k}": float(metric.compute()) for k, metric in passes.items()})
        return results


def build_env(env, env_kwargs, agent_prompts, reward_fn, transition, transition_kwargs, batched: bool) -> Env:
    """``data.env`` (an object, or a name / import path with ``env_kwargs``), or the text environment
    ``agent_prompts`` + ``reward_fn`` (+ ``transition``) describe."""
    if env is not None and (agent_prompts or reward_fn or transition):
        raise ConfigError(
            "data.env gives the prompts, rewards and transitions: drop data.agent_prompts, data.reward_fn and "
            "data.transition, or drop data.env"
        )
    if isinstance(env, str):
        return make_env(env, env_kwargs)
    if env is not None:
        return env
    if not agent_prompts:
        raise ConfigError(
            "data.env: give an environment (a registered name such as corridor, or an object), or "
            "data.agent_prompts (one prompt template per agent) with data.reward_fn"
        )
    if not reward_fn:
        raise ConfigError("data.reward_fn: give the import path of a reward function (or give data.env)")
    step = _function(transition, "data.transition") if transition else None
    return FunctionEnv(agent_prompts, _function(reward_fn, "data.reward_fn"), step, transition_kwargs, batched)


def _function(value, field: str):
    """An import path's object, or the function itself (the Python API)."""
    if isinstance(value, str):
        return import_object(value, field)
    if not callable(value):
        raise ConfigError(f"{field}={value!r}: give an import path ('package.module:function') or a function")
    return value
