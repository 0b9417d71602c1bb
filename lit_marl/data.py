"""RolloutDataModule: task rows in, rollouts out, built on the fly with the current policies.

The dataloaders yield plain task rows. The rollout is built in ``on_after_batch_transfer``,
which Lightning calls right before each ``training_step`` - after the previous update - so
every rollout comes from the current weights (the loader's prefetch only touches task rows).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Literal, NamedTuple

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lit_marl import ConfigError
from lit_marl.agents import Team
from lit_marl.envs import make_env
from lit_marl.envs.alfworld.games import ALIASES as ALFWORLD_ALIASES
from lit_marl.envs.base import Env, FunctionEnv, TextEnv
from lit_marl.envs.calls import CallSettings, RewardError
from lit_marl.envs.centralized import CentralizedEnv
from lit_marl.envs.game import Game
from lit_marl.envs.learned import JointRewardModel, LearnedRewardEnv
from lit_marl.envs.processors import RewardProcessor, check_range
from lit_marl.envs.sources import resolve_demo_source
from lit_marl.fields import (
    PositiveFloat,
    PositiveInt,
    UnitIntervalLeftOpen,
    UnitIntervalRightOpen,
    check_fields,
)
from lit_marl.generation import make_engine
from lit_marl.generation.base import stream_seed
from lit_marl.metrics import EvalMeans, PassAtK
from lit_marl.returns import CrossReduce, JointMode, step_reward, turn_rewards
from lit_marl.rollout.batch import RolloutBatch
from lit_marl.rollout.demos import load_demos, render_demos
from lit_marl.rollout.episode import EpisodeSettings, run_episodes
from lit_marl.rollout.settings import RolloutSettings
from lit_marl.rollout.tree import TreeSettings, build_tree
from lit_marl.tasks import TaskLoader, import_object, mixture, task_loader


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
    before the training step. Configs name the subclass: ``data: {class_path: ..., init_args: ...}``."""

    train_tasks: list[dict]
    val_tasks: list[dict]
    demos: list[dict] = []
    examples: list[dict] = []
    """The final joint answer of each held-out task of this rank's latest ``evaluate`` (greedy)."""
    demo_rows: int | None = None
    """How many demonstrations the coming SFT epoch may serve, counted from its start (``PhaseSwitch``
    sets it from the budget); None: whole passes."""

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
                rows, size, name = self.demos, self.hparams.demo_batch_size, "demos"
                if not rows:
                    raise ConfigError("the SFT phase needs demonstrations: set data.demo_path (scripts/make_demos.py)")
            else:
                rows, size, name = self.train_tasks, self.hparams.tasks_per_step, "tasks"
            loader = TaskLoader(rows, size, self.hparams.seed, rank, world, name)
            self._loaders[phase] = cached = (trainer, loader)
        self.train_loader = cached[1]
        self.train_loader.end_after(self.demo_rows if phase == "sft" else None)
        return self.train_loader

    def on_after_batch_transfer(self, batch: list[dict], dataloader_idx: int):
        """Rows become what the training step consumes: rendered demonstrations in the SFT phase,
        rollouts of the current weights otherwise (greedy outside training)."""
        team = self.trainer.lightning_module.team()  # the one handshake of the step
        if self.trainer.training and team.phase == "sft":
            return render_demos(team.agents, batch, self.hparams.demo_loss_on)
        with team.computing(self.engine), self.engine.rollout(team.agents):
            return self.rollout_batch(team, batch, training=self.trainer.training)

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


class RolloutDataModule(TaskDataModule):
    def __init__(
        self,
        train_path: str,
        agent_prompts: list[str] | None = None,
        reward_fn: str | None = None,
        env: Env | str | None = None,
        env_kwargs: dict | None = None,
        val_path: str | None = None,
        tasks_per_step: PositiveInt = 4,
        num_generations: PositiveInt = 4,
        joint_mode: JointMode = "aligned",
        cross_return: CrossReduce = "mean",
        max_new_tokens: PositiveInt = 64,
        temperature: PositiveFloat = 1.0,
        top_p: UnitIntervalLeftOpen = 1.0,
        eval_tasks_per_step: PositiveInt = 16,
        seed: int = 0,
        num_turns: PositiveInt = 1,
        transition: str | None = None,
        transition_kwargs: dict | None = None,
        batched_transition: bool = False,
        transition_prompt_field: str = "prompt",
        external_prompt_passthrough: bool = False,
        early_termination_threshold: float | None = None,
        on_reward_error: Literal["raise", "skip"] = "raise",
        reward_timeout_s: PositiveFloat | None = 600.0,
        transition_timeout_s: PositiveFloat | None = 600.0,
        max_skipped_steps: PositiveInt = 3,
        engine: str = "auto",
        engine_options: dict | None = None,
        demo_path: str | None = None,
        demo_batch_size: PositiveInt = 8,
        demo_loss_on: Literal["all", "last"] = "all",
        reward_processor: list[dict] | None = None,
        reward_range: list[float] | None = None,
        centralized_adapter: str | None = None,
        parse_failure_reward: float | None = 0.0,
        reward_model: str | None = None,
        sampling_streams: Literal["shared", "per_task"] = "shared",
        reward_density: Literal["sparse", "dense"] = "sparse",
        score_weight: UnitIntervalRightOpen | None = None,
        branch: Literal["clone", "replay"] | None = None,
    ):
        """
        Args:
            train_path: Task rows for training (JSONL/JSON/CSV/Parquet), read with ``datasets``, or a
                source the environment knows (e.g. ``humaneval[:130]`` for the code environment).
            agent_prompts: One format string per agent, filled from a task row's fields
                (``{topic}``); the number of entries is the number of agents. With ``reward_fn``;
                not with ``env``.
            reward_fn: Import path of the joint reward function (``module:function``), called once
                per turn with ``agent_completions=[agent][joint action]`` and ``tasks=[joint action]``.
            env: The environment, as in every data module: an object (``class_path`` + ``init_args``,
                e.g. ``lit_marl.envs.code.CodeEnv``), or a registered name (``textworld-team``, ...) or
                import path (``my_package.games:MyGame``) built with ``env_kwargs``; a game's nodes hold
                game states. It gives the prompts, the rewards and the next turn's prompts; replaces
                ``agent_prompts``, ``reward_fn`` and ``transition``.
            env_kwargs: Keyword arguments of ``env`` when it is a name.
            val_path: Held-out task rows for validation, test and the before/after evaluation.
            tasks_per_step: Tasks (tree roots) per training step.
            num_generations: Responses G each agent samples at every tree node.
            joint_mode: ``aligned`` pairs responses by index (G joint actions per node);
                ``cross`` takes the Cartesian product (G^N).
            cross_return: In ``cross`` mode a response's return is the ``mean`` over the joint actions
                that contain it, or their ``sum`` (CoMLRL's: G^(N-1) times larger, which only a
                normalized advantage does not see).
            max_new_tokens: Generation budget per response.
            temperature: Sampling temperature for training rollouts (evaluation is greedy).
            top_p: Nucleus sampling for training rollouts.
            eval_tasks_per_step: Tasks per batch in validation/test (greedy, one response each).
            seed: Seed of the task order.
            num_turns: Turns T of the joint tree (G^T leaves per task when aligned).
            transition: Import path of the external transition that builds each child node's
                prompts from its branch's histories (needed when num_turns > 1), e.g.
                ``lit_marl.rollout.transitions:plain``.
            transition_kwargs: Extra keyword arguments bound to the transition.
            batched_transition: Call the transition once per turn with every keyword argument a list
                over all branches (it returns one prompt list per branch), e.g. to run all branches'
                tests in one pool; otherwise once per branch (CoMLRL's interface).
            transition_prompt_field: The task row's field the transition receives as ``prompt``
                (the task's prompt text, as CoMLRL passes ``batch_item["prompt"]``); a row without
                it passes the empty string, as CoMLRL does, and a warning names the field.
            external_prompt_passthrough: Use the transition's prompts verbatim instead of rendering
                them with the agent's chat template.
            early_termination_threshold: A node whose mean reward exceeds this gets no children;
                None (default) never stops early - a threshold such as CoMLRL's -0.2 would end every
                tree after one turn whenever rewards are non-negative.
            on_reward_error: ``raise`` (default) stops on a reward function that raises or returns
                NaN/inf, naming the task and turn; ``skip`` gives such samples a neutral reward (no
                advantage) and reports their fraction as the metric ``skipped_reward_frac``
                (``reward_batch_failures``: batch calls that failed and were retried per joint action;
                ``reward_timeouts``: batch calls skipped for their time).
            reward_timeout_s: Time limit of one batched reward call (None: none). Past it the run
                stops naming the reward, or under ``on_reward_error: skip`` the batch is skipped.
            transition_timeout_s: Time limit of one batched transition call (None: none); past it the
                run stops naming the transition.
            max_skipped_steps: Under ``on_reward_error: skip``, stop after this many training steps
                in a row whose every reward was skipped (nothing is being learned).
            engine: What generates: ``auto`` (default: the lean ``torch`` decoder for Llama/Qwen2
                models, transformers' ``generate`` for the rest), ``torch``, ``hf`` or ``vllm``
                (GPU, installed separately; weights synced from the trainer before each rollout).
            engine_options: Settings of the vllm engine (e.g. ``gpu_memory_utilization``).
            sampling_streams: ``shared`` (default): training samples draw from torch's random generator,
                so a response depends on the other prompts of its batch and rank; ``per_task``: each
                response has its own counter-based stream (the run's seed, the step, the task, its tree
                node, role and sample index), so a task samples the same responses on 1 rank or N
                (a task twice in one step samples the same responses twice). Lean decoder only
                (``engine: auto`` / ``torch`` with a Llama-family model).
            demo_path: Demonstrations for SFT (the ``SFT`` module, or the first phase of
                ``callbacks.PhaseSwitch``): JSONL rows with one chat per agent (``lit_marl/rollout/demos.py``;
                ``scripts/make_demos.py`` writes them from an environment's expert).
            demo_batch_size: Demonstrations per SFT step.
            demo_loss_on: ``all``: the loss on every assistant turn of a demonstration; ``last``: on
                its last assistant turn only (the earlier ones are context).
            reward_processor: Steps applied in order to every joint action's reward before returns
                (CoMLRL's reward processors): ``{kind: clamp, min, max}``, ``{kind: scale, factor}``,
                ``{kind: shift, offset}``, ``{kind: sigmoid_scale}``, ``{kind: normalize_by_length,
                max_len}`` (times min(1, answer characters / max_len)), ``{kind: identity}``. Logs,
                early termination and evaluation keep the task reward (``lit_marl/envs/processors.py``).
            reward_range: ``[min, max]`` of the task reward (default: the reward function's
                ``reward_range`` attribute, if any): metadata, never a clip; carried through the
                processor, it fixes the bins of the reward histograms.
            centralized_adapter: Import path of an adapter class (``module:Class``, e.g.
                ``lit_marl.envs.centralized:TaggedAdapter``): ONE joint actor writes every role's
                output in one completion (``CentralizedMAGRPO``); the adapter builds its prompt from the
                roles' prompts and splits its completion into roles for the reward. Single-turn.
            parse_failure_reward: With ``centralized_adapter``, the reward of a completion without
                every role's section (counted as ``parse_failed``; set it to the reward's minimum when
                rewards can be negative); null scores its roles as empty strings with the task reward
                (CoMLRL's behaviour).
            reward_model: A trained joint reward model's folder (``RewardModelFit``'s
                ``reward_model_dir``): training rollouts are rewarded by its score of each joint
                answer instead of the task reward (MARLHF); held-out evaluation keeps the task reward.
            reward_density: How a game's outcome becomes rewards (``env`` a game), as in ``EpisodeDataModule``.
            score_weight: Weight of a game's normalized score, as in ``EpisodeDataModule``.
            branch: How a game's joint action gets its own game (``env`` a game): ``clone`` copies the
                node's state, ``replay`` starts the game again and replays the branch's commands;
                default: clone where the game can.
        """
        super().__init__()
        check_fields("data", RolloutDataModule.__init__, locals())
        if env is not None and (agent_prompts or reward_fn or transition):
            raise ConfigError(
                "data.env gives the prompts, rewards and transitions: drop data.agent_prompts, data.reward_fn and "
                "data.transition, or drop data.env"
            )
        if env is None and not agent_prompts:
            raise ConfigError("data.agent_prompts: give one prompt template per agent (or give data.env)")
        if env is None and not reward_fn:
            raise ConfigError("data.reward_fn: give the import path of a reward function (or give data.env)")
        if num_turns > 1 and transition is None and env is None:
            raise ConfigError(
                f"data.num_turns={num_turns} needs data.transition (e.g. lit_marl.rollout.transitions:plain) "
                "to build the next turn's prompts"
            )
        self.save_hyperparameters(ignore=["env"])
        self.engine = build_engine(engine, engine_options)
        if sampling_streams == "per_task" and engine not in ("auto", "torch"):
            raise ConfigError(
                f"data.sampling_streams=per_task samples with the lean decoder; data.engine={engine!r} cannot: "
                "use data.engine: auto (or torch), or data.sampling_streams: shared"
            )
        if isinstance(env, str):
            env = make_env(env, env_kwargs)
        if env is None:
            env = FunctionEnv(
                agent_prompts,
                import_object(reward_fn, "data.reward_fn"),
                import_object(transition, "data.transition") if transition else None,
                transition_kwargs,
                batched_transition,
            )
        if centralized_adapter is not None:
            if num_turns > 1:
                raise ConfigError(
                    f"data.centralized_adapter: a joint actor plays one turn; data.num_turns={num_turns} must be 1"
                )
            adapter = import_object(centralized_adapter, "data.centralized_adapter")
            env = CentralizedEnv(env, adapter() if isinstance(adapter, type) else adapter, parse_failure_reward)
        step_reward(0, 0, 1, False, True, reward_density, score_weight)  # checks the two settings
        if branch is not None:
            if not isinstance(env, Game):
                raise ConfigError(f"data.branch={branch!r} applies to games; {type(env).__name__} is not one")
            if branch == "clone" and not env.cloneable:
                raise ConfigError(
                    f"data.branch=clone: the {type(env).__name__} environment cannot copy its state; "
                    "set data.branch=replay"
                )
            env.branching = branch
        if num_turns > 1 and not env.multi_turn:
            raise ConfigError(f"data.num_turns={num_turns}: {type(env).__name__} has no transition (single-turn)")
        self.env = env
        # what rewards training rollouts: the task reward, or a learned one (MARLHF); evaluation: the task's
        if reward_model is not None and not isinstance(env, TextEnv):
            raise ConfigError(
                f"data.reward_model scores joint answers of a text environment; {type(env).__name__} is a game whose "
                "reward is its own: drop data.reward_model"
            )
        self.train_env = LearnedRewardEnv(env, JointRewardModel.load(reward_model)) if reward_model else env
        calls = CallSettings(on_reward_error, reward_timeout_s, transition_timeout_s, transition_prompt_field)
        for text_env in {id(e): e for e in (env, self.train_env) if isinstance(e, TextEnv)}.values():
            text_env.call_settings = calls
        processor = RewardProcessor.parse(reward_processor)
        raw_range = check_range(reward_range, "data.reward_range")
        inner = env.inner if isinstance(env, CentralizedEnv) else env
        if raw_range is None and isinstance(inner, FunctionEnv):
            raw_range = check_range(getattr(inner.reward_fn, "reward_range", None), f"{reward_fn}.reward_range")
        self.reward_range = raw_range
        """The task reward's [min, max] (what is logged and evaluated), or None: unknown."""
        self.load_demos(demo_path)
        self.train_tasks = env.load_tasks(train_path, "data.train_path")
        self.val_tasks = env.load_tasks(val_path, "data.val_path") if val_path else []
        # how training trees grow (evaluation: one greedy response per node); algorithms check theirs against it
        self.tree = TreeSettings(
            num_generations=num_generations,
            joint_mode=joint_mode,
            cross_return=cross_return,
            num_turns=num_turns,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            early_termination_threshold=early_termination_threshold,
            external_prompt_passthrough=external_prompt_passthrough,
            reward_processor=processor,
            reward_density=reward_density,
            score_weight=score_weight,
        )
        self.max_skipped_steps, self._skipped_steps = max_skipped_steps, 0
        # a user's transition reads the task prompt (an env's own, or one marked like ``plain``, may not)
        user_transition = isinstance(env, FunctionEnv) and env.has_transition
        user_transition = user_transition and getattr(env.transition_fn.func, "reads_task_prompt", True)
        lacking = [t for t in self.train_tasks + self.val_tasks if transition_prompt_field not in t]
        if num_turns > 1 and user_transition and lacking:
            rank_zero_warn(
                f"data.transition_prompt_field={transition_prompt_field!r}: {len(lacking)} task rows of "
                f"data.train_path / data.val_path have no such field (e.g. one with {sorted(lacking[0])}), so the "
                "transition's `prompt` argument is the empty string for them (CoMLRL's behaviour); set "
                "data.transition_prompt_field to the field that holds the task's prompt"
            )

    @property
    def num_agents(self) -> int:
        return self.env.num_agents

    @property
    def num_generations(self) -> int:
        return self.tree.num_generations

    def prompts_for(self, tasks: list[dict]) -> list[list[str]]:
        return [state.observations for state in self.env.reset(tasks)]

    def rollout(self, agents, tasks: list[dict], greedy: bool, engine=None, stream: str = "policy") -> RolloutBatch:
        """``stream`` names the per-task sampling streams of the rollout (``sampling_streams: per_task``)."""
        settings = replace(self.tree, num_generations=1, greedy=True) if greedy else self.tree
        if (
            not greedy and self.hparams.sampling_streams == "per_task"
        ):  # the same on every rank; resumes with the loader
            seed = stream_seed(torch.initial_seed(), self.hparams.seed, self.train_loader.consumed, stream)
            settings = replace(settings, sampling_seed=seed)
        env = self.env if greedy else self.train_env
        batch = build_tree(list(agents), tasks, env, settings, engine or self.engine)
        batch.reward_range = self.reward_range if env is self.env else None
        return batch

    @property
    def rollout_settings(self) -> RolloutSettings:
        return RolloutSettings(
            "tree",
            self.num_agents,
            self.hparams.tasks_per_step,
            self.tree.num_generations,
            self.engine,
            tree=self.tree,
            centralized=isinstance(self.env, CentralizedEnv),
            on_reward_error=self.hparams.on_reward_error,
            demos=len(self.demos),
        )

    def rollout_batch(self, team: Team, tasks: list[dict], training: bool) -> RolloutBatch:
        if not training:
            return self.rollout(team.agents, tasks, greedy=True)
        with team.sampling() as agents:
            batch = self.rollout(agents, tasks, greedy=False)
        self._count_skipped(batch)
        with team.comparator(tasks) as comparator:
            if comparator is not None:
                rollout = self.rollout(
                    comparator.agents, tasks, greedy=False, engine=comparator.engine, stream="comparator"
                )
                batch.comparator = comparator.checked(rollout)
        return batch

    def _count_skipped(self, batch: RolloutBatch) -> None:
        """Stop a run whose rewards are all skipped, step after step: it would train nothing and end
        as if it had."""
        if batch.metrics.get("skipped_reward_frac", 0.0) < 1.0:
            self._skipped_steps = 0
            return
        self._skipped_steps += 1
        if self._skipped_steps >= self.max_skipped_steps:
            raise RewardError(
                f"every reward of the last {self._skipped_steps} training steps was skipped "
                "(data.on_reward_error=skip: it raised, timed out or was NaN/inf for every sample), so nothing is "
                "being learned. Fix the reward "
                "(run it on a few samples by hand), or raise data.max_skipped_steps"
            )

    def episodes(self, batch: RolloutBatch) -> float:
        """Joint trajectories from a root to a leaf of the trees."""
        return batch.stats["train/episodes"]

    def evaluation_metrics(self, agents, tasks: list[dict], num_samples: int = 1) -> Evaluated:
        """The mean reward and the metrics the reward reported; with ``num_samples`` > 1 every task's
        tree is sampled (aligned: the joint trajectories are its leaves) and a leaf succeeds where
        the reward reports ``success`` 1 at its last joint action."""
        if num_samples == 1:
            rollout = self.rollout(agents, tasks, greedy=True)
        else:
            settings = replace(self.tree, num_generations=num_samples, joint_mode="aligned")
            rollout = build_tree(list(agents), tasks, self.env, settings, self.engine)
        successes = None
        if rollout.leaf_success is not None and len(rollout.leaf_tasks):
            # leaves per task differ where branches end early (early termination, a game's end)
            samples = torch.bincount(rollout.leaf_tasks, minlength=len(tasks))
            won = (rollout.leaf_success == 1.0).double()
            successes = samples, torch.bincount(rollout.leaf_tasks, weights=won, minlength=len(tasks)).long()
        examples = []
        last = rollout.turn_rewards[-1]  # the last turn's joint actions, one per task still playing
        if num_samples == 1 and len(last) == len(tasks):  # greedy, every task reached the last turn
            answers = [agent[-len(tasks) :] for agent in rollout.completions]
            examples = [
                {"task": task, "lines": [agent[j] for agent in answers], "reward": float(last[j])}
                for j, task in enumerate(tasks)
            ]
        return Evaluated({"reward": float(rollout.rewards.mean()), **rollout.metrics}, successes, examples)


class EpisodeDataModule(TaskDataModule):
    """Task rows in, multi-turn episodes in a stateful environment out (``rollout/episode.py``),
    built on the fly with the current policy, G episodes per task."""

    def __init__(
        self,
        train_path: str,
        env: Env | str = "corridor",
        env_kwargs: dict | None = None,
        val_path: str | None = None,
        tasks_per_step: PositiveInt = 4,
        num_generations: PositiveInt = 4,
        max_turns: PositiveInt = 8,
        max_new_tokens: PositiveInt = 32,
        max_context_tokens: PositiveInt = 2048,
        temperature: PositiveFloat = 1.0,
        top_p: UnitIntervalLeftOpen = 1.0,
        reward_density: Literal["sparse", "dense"] = "sparse",
        score_weight: UnitIntervalRightOpen | None = None,
        eval_tasks_per_step: PositiveInt = 16,
        env_workers: PositiveInt = 8,
        seed: int = 0,
        engine: str = "auto",
        engine_options: dict | None = None,
        demo_path: str | None = None,
        demo_batch_size: PositiveInt = 8,
        demo_loss_on: Literal["all", "last"] = "all",
        task_types: list[str] | None = None,
        anchor: Literal["state", "observation"] = "state",
        reasoning: Literal["none", "think"] = "none",
        history: Literal["verbatim", "strict"] = "verbatim",
    ):
        """
        Args:
            train_path: Task rows for training (JSONL/JSON/CSV/Parquet), one episode start each, or a named
                game set (``envs/sources.py``): ``textworld:<complexity>:<split>:<count>``,
                ``alfworld:<split>:<count per task type>`` (generated once, cached) or
                ``alfworld-data:<split>[:<count>]`` (the official games under ``$ALFWORLD_DATA``).
            env: The environment, as in every data module: a registered name (``corridor``, ``textworld``,
                ``alfworld``, ``swe``) or the import path of an ``Env`` of your own
                (``my_package.games:MyGame``), built with ``env_kwargs``; or an object (``class_path`` +
                ``init_args``, e.g. ``lit_marl.envs.code.CodeEnv``: a text environment plays as episodes,
                its reward each turn's).
            env_kwargs: Keyword arguments of the environment's constructor.
            val_path: Held-out task rows (validation/test: one greedy episode each).
            tasks_per_step: Tasks per training step.
            num_generations: Episodes G per task from the same start (GRPO/RLOO groups; 1 for PPO).
            max_turns: Turns per episode; an episode still running after them is ``truncated``.
            max_new_tokens: Tokens per reply.
            max_context_tokens: Budget of a whole episode's sequence: when the next observation and
                a reply would not fit, the episode ends as ``truncated`` with what it earned.
            temperature: Sampling temperature of training episodes.
            top_p: Nucleus sampling of training episodes.
            reward_density: ``sparse``: the outcome (won) on the last reply's end token; ``dense``:
                each turn's score delta (normalized by the episode's max_score) on its end token,
                plus the outcome at the end.
            score_weight: Weight of the normalized score (sparse: the final score; dense: the deltas),
                in [0, 1) so no lost episode outscores a won one; default 0 (sparse), 0.5 (dense).
            eval_tasks_per_step: Tasks per validation batch.
            env_workers: Threads that step the environments of a turn in parallel.
            seed: Seed of the task order.
            engine: What generates: ``auto`` (default), ``torch``, ``hf`` or ``vllm``, as in
                ``RolloutDataModule``.
            engine_options: Settings of the vllm engine.
            demo_path: Demonstrations for SFT (the ``SFT`` module, or the first phase of
                ``callbacks.PhaseSwitch``): JSONL rows with one chat per agent (``lit_marl/rollout/demos.py``;
                ``scripts/make_demos.py`` writes them from an environment's expert), or the walkthroughs
                of a named TextWorld game set ``textworld:<complexity>:<split>:<count>`` played in this
                environment (written once, cached; a split other than train's and val's).
            demo_batch_size: Demonstrations per SFT step.
            demo_loss_on: ``all``: the loss on every assistant turn of a demonstration; ``last``: on
                its last assistant turn only (the earlier ones are context).
            task_types: Train and evaluate only on rows of these task types (the rows' ``task_type``,
                e.g. ALFWorld's), training on them in equal shares: the rarer types' rows repeat so
                each type has as many as the most common (the guide's mixture experiment). None:
                every row as given. Evaluation reports the success of every task type either way.
            anchor: What makes two turns of a task's episodes one anchor state for step-level
                groups (``model.step_advantage_weight``): ``state``, the env's canonical state
                (TextWorld's and ALFWorld's facts, Corridor's room and items; the observation where
                an env has none); ``observation``, the agent's observation text.
            reasoning: ``think``: a reply's ``<think>...</think>`` block is the agent's reasoning (Qwen3): the env
                acts on the text after it (nothing while unclosed); trained on whole either way. ``none``: all of it.
            history: For chat templates that rewrite earlier turns (Qwen3's think blocks): ``verbatim`` keeps each
                reply as generated in the context (exact training; a warning); ``strict`` refuses such templates.
        """
        super().__init__()
        self.env = make_env(env, env_kwargs) if isinstance(env, str) else env  # a bad name or kwargs fails here
        self.num_agents = self.env.num_agents
        check_fields("data", EpisodeDataModule.__init__, locals())
        step_reward(0, 0, 1, False, True, reward_density, score_weight)  # checks the two settings
        if max_context_tokens <= max_new_tokens:
            raise ConfigError(f"data.max_context_tokens={max_context_tokens}: must exceed max_new_tokens")
        self.save_hyperparameters(ignore=[] if isinstance(env, str) else ["env"])
        self.engine = build_engine(engine, engine_options)
        env_name = env if isinstance(env, str) else type(env).__qualname__
        others = {"data.train_path": train_path, "data.val_path": val_path}  # demonstrations never from these games
        self.load_demos(demo_path and resolve_demo_source(demo_path, self.env, env_name, env_kwargs, others))
        self.train_tasks = self.env.load_tasks(train_path, "data.train_path")
        self.val_tasks = self.env.load_tasks(val_path, "data.val_path") if val_path else []
        if task_types:
            task_types = [ALFWORLD_ALIASES.get(kind, kind) for kind in task_types]  # ALFWorld's short names
            self.train_tasks = mixture(self.train_tasks, task_types, "data.task_types (train rows)")
            if self.val_tasks:  # held-out games are played once each: filtered, not repeated
                self.val_tasks = [row for row in self.val_tasks if row.get("task_type") in task_types]
                held_out = {row["task_type"] for row in self.val_tasks}
                if held_out != set(task_types):
                    raise ConfigError(
                        f"data.task_types={task_types}: data.val_path holds no rows of "
                        f"{sorted(set(task_types) - held_out)}"
                    )
            if self.demos:  # the SFT phase is the same mixture (rows without a type are kept)
                self.demos = [d for d in self.demos if (d.get("task_type") or task_types[0]) in task_types]
        self.num_generations = num_generations
        # how training episodes are played (evaluation: one greedy episode per task)
        self.episode = EpisodeSettings(
            group_size=num_generations,
            max_turns=max_turns,
            max_new_tokens=max_new_tokens,
            max_context_tokens=max_context_tokens,
            temperature=temperature,
            top_p=top_p,
            anchor=anchor,
            reasoning=reasoning,
            history=history,
        )
        self.env.pool = ThreadPoolExecutor(max_workers=env_workers)

    def rollout(self, agents, tasks: list[dict], greedy: bool, group_size: int | None = None):
        """One batch per agent; the team shares the turn rewards made from the env's score. Greedy:
        one episode per task; else ``group_size`` (default ``num_generations``) sampled ones."""
        hp = self.hparams
        settings = replace(self.episode, group_size=1, greedy=True) if greedy else self.episode
        if group_size is not None and not greedy:
            settings = replace(settings, group_size=group_size)
        batches = run_episodes(list(agents), tasks, self.env, settings, self.engine)
        first = batches[0]
        if first.rewards is None:  # a game: its outcome by the density rule, the team's
            rewards = turn_rewards(
                first.scores, first.won, first.max_score, first.num_turns, hp.reward_density, hp.score_weight
            )
            for batch in batches:
                batch.rewards = rewards
        return batches

    @property
    def rollout_settings(self) -> RolloutSettings:
        return RolloutSettings(
            "episodes",
            self.num_agents,
            self.hparams.tasks_per_step,
            self.num_generations,
            self.engine,
            episode=self.episode,
            demos=len(self.demos),
        )

    def rollout_batch(self, team: Team, tasks: list[dict], training: bool):
        return self.rollout(team.agents, tasks, greedy=not training)

    def episodes(self, batches) -> float:
        return float(len(batches[0].won))

    def evaluation_metrics(self, agents, tasks: list[dict], num_samples: int = 1) -> Evaluated:
        """One greedy episode per task (or ``num_samples`` sampled ones): win rate, mean episode
        reward, final score, length; with task types or complexities in the rows (ALFWorld's,
        TextWorld's), the win rate of each, ``won/<task type>``, ``won/<complexity>``; a won episode
        succeeds."""
        # the outcome is the team's: agent 0's batch holds it
        episodes = self.rollout(agents, tasks, greedy=num_samples == 1, group_size=num_samples)[0]
        won = episodes.won.view(len(tasks), -1)
        metrics = {
            "reward": float(episodes.rewards.sum(dim=1).mean()),
            "won": float(episodes.won.float().mean()),
            "final_score": float((episodes.scores[:, -1] / episodes.max_score).mean()),
            "turns": float(episodes.num_turns.float().mean()),
        }
        for field in ("task_type", "complexity"):
            for kind in sorted({str(task[field]) for task in tasks if field in task}):
                mine = [i for i, task in enumerate(tasks) if str(task.get(field)) == kind]
                metrics[f"won/{kind}"] = (float(won[mine].float().mean()), len(mine))
        return metrics, (torch.full((len(tasks),), won.shape[1]), won.sum(dim=1))
