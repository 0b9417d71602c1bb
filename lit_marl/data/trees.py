"""RolloutDataModule: task rows in, joint rollout trees out (``rollout/tree.py``), built on the
fly with the current policies."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_marl import ConfigError
from lit_marl.agents import Team
from lit_marl.data.base import Evaluated, TaskDataModule
from lit_marl.envs.base import FunctionEnv, TextEnv
from lit_marl.envs.calls import RewardError
from lit_marl.envs.centralized import CentralizedEnv
from lit_marl.envs.game import Game
from lit_marl.envs.learned import JointRewardModel, LearnedRewardEnv
from lit_marl.envs.processors import RewardProcessor, check_range
from lit_marl.fields import PositiveInt, as_group, check_fields
from lit_marl.generation.base import stream_seed
from lit_marl.returns import CrossReduce, JointMode
from lit_marl.rollout.batch import RolloutBatch
from lit_marl.rollout.settings import RolloutSettings
from lit_marl.rollout.tree import TreeSettings, build_tree
from lit_marl.rollout.tree_tools import TreeTools
from lit_marl.tasks import import_object


class RolloutDataModule(TaskDataModule):
    """Task rows in, joint rollout trees out: at every node each agent samples ``num_generations``
    responses and the joint actions branch over the environment's states. Besides every data
    module's settings (``TaskDataModule``):

    Args:
        joint_mode: ``aligned`` pairs responses by index (G joint actions per node); ``cross`` takes the
            Cartesian product (G^N).
        cross_return: In ``cross`` mode a response's return is the ``mean`` over the joint actions that
            contain it, or their ``sum`` (CoMLRL's: G^(N-1) times larger, which only a normalized advantage
            does not see).
        num_turns: Turns T of the joint tree (G^T leaves per task when aligned).
        external_prompt_passthrough: After the first turn each agent reads the transition's prompt as it is;
            otherwise (default, CoMLRL's) the prompt becomes the task row's ``transition_prompt_field`` and goes
            through the agent's formatter (``agent_prompts``) again.
        chat_template: Render each prompt as a user message in the model's chat template (with the model's
            ``system_prompt``); false tokenizes the prompt text as it is (CoMLRL's way: the formatter writes the
            whole prompt).
        early_termination_threshold: A node whose mean reward exceeds this gets no children; None (default)
            never stops early - a threshold such as CoMLRL's -0.2 would end every tree after one turn whenever
            rewards are non-negative.
        reward_processor: Steps applied in order to every joint action's reward before returns (CoMLRL's reward
            processors): ``{kind: clamp, min, max}``, ``{kind: scale, factor}``, ``{kind: shift, offset}``,
            ``{kind: sigmoid_scale}``, ``{kind: normalize_by_length, max_len}`` (times min(1, answer characters /
            max_len)), ``{kind: identity}``. Logs, early termination and evaluation keep the task reward
            (``lit_marl/envs/processors.py``).
        reward_range: ``[min, max]`` of the task reward (default: the reward function's ``reward_range``
            attribute, if any): metadata, never a clip; carried through the processor, it fixes the bins of
            the reward histograms.
        centralized_adapter: Import path of an adapter class (``module:Class``, e.g.
            ``lit_marl.envs.centralized:TaggedAdapter``): ONE joint actor writes every role's output in one
            completion (``CentralizedMAGRPO``); the adapter builds its prompt from the roles' prompts and splits
            its completion into roles for the reward. Single-turn.
        parse_failure_reward: With ``centralized_adapter``, the reward of a completion without every role's
            section (counted as ``parse_failed``; set it to the reward's minimum when rewards can be negative);
            null scores its roles as empty strings with the task reward (CoMLRL's behaviour).
        reward_model: A trained joint reward model's folder (``RewardModelFit``'s ``reward_model_dir``):
            training rollouts are rewarded by its score of each joint answer instead of the task reward
            (MARLHF); held-out evaluation keeps the task reward.
        sampling_streams: ``shared`` (default): training samples draw from torch's random generator, so a
            response depends on the other prompts of its batch and rank; ``per_task``: each response has its
            own counter-based stream (the run's seed, the step, the task, its tree node, role and sample
            index), so a task samples the same responses on 1 rank or N. The lean decoder (``engine: auto`` /
            ``torch`` with a Llama-family model) and ``vllm_server`` (each request seeded with its stream's seed).
        branch: How a game's joint action gets its own game (``env`` a game): ``clone`` copies the node's state,
            ``replay`` starts the game again and replays the branch's commands; default: clone where it can.
        tools: Tools every agent may call within its turn (a text environment's; ``rollout.tree_tools.TreeTools``):
            ``{functions: [module:function, ...], parser, max_rounds, max_calls_per_turn, call_timeout_s,
            max_result_chars, share}``. A reply with calls gets their results back in the agent's own format and
            the agent replies again, up to ``max_rounds`` times; its last reply is the answer the reward reads.
            Every reply is trained, the results are not (docs/tools.md).
    """

    def __init__(
        self,
        joint_mode: JointMode = "aligned",
        cross_return: CrossReduce = "mean",
        num_turns: PositiveInt = 1,
        external_prompt_passthrough: bool = False,
        chat_template: bool = True,
        early_termination_threshold: float | None = None,
        reward_processor: list[dict] | None = None,
        reward_range: list[float] | None = None,
        centralized_adapter: str | None = None,
        parse_failure_reward: float | None = 0.0,
        reward_model: str | None = None,
        sampling_streams: Literal["shared", "per_task"] = "shared",
        branch: Literal["clone", "replay"] | None = None,
        tools: TreeTools | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_fields("data", RolloutDataModule.__init__, locals())
        hp = self.hparams
        if self.env.tools:
            raise ConfigError(
                f"data.env offers tools ({', '.join(t.name for t in self.env.tools)}): a game's tool calls are played "
                "in episodes (lit_marl.data.EpisodeDataModule, docs/tools.md); in a tree, give a text environment's "
                "agents tools with data.tools"
            )
        tools = None if tools is None else self._tools(as_group(TreeTools, tools), chat_template, sampling_streams)
        if num_turns > 1 and isinstance(self.env, FunctionEnv) and not self.env.has_transition:
            raise ConfigError(
                f"data.num_turns={num_turns} needs data.transition (e.g. lit_marl.rollout.transitions:plain) "
                "to build the next turn's prompts"
            )
        if sampling_streams == "per_task" and hp.engine not in ("auto", "torch", "vllm_server"):
            raise ConfigError(
                f"data.sampling_streams=per_task samples with the lean decoder or seeds vllm_server's requests; "
                f"data.engine={hp.engine!r} cannot: use data.engine: auto, torch or vllm_server, or "
                "data.sampling_streams: shared"
            )
        if isinstance(self.env, FunctionEnv):
            self.env.passthrough = external_prompt_passthrough  # its call_settings name the prompt field
            if num_turns > 1:
                self.env.check_formatters()
        self.env = self._wrapped(centralized_adapter, parse_failure_reward, num_turns, branch)
        # what rewards training rollouts: the task reward, or a learned one (MARLHF); evaluation: the task's
        if reward_model is not None and not isinstance(self.env, TextEnv):
            raise ConfigError(
                f"data.reward_model scores joint answers of a text environment; {type(self.env).__name__} is a "
                "game whose reward is its own: drop data.reward_model"
            )
        self.train_env = LearnedRewardEnv(self.env, JointRewardModel.load(reward_model)) if reward_model else self.env
        self.configure_envs(self.env, self.train_env)
        self.reward_range = self._reward_range(reward_range)
        """The task reward's [min, max] (what is logged and evaluated), or None: unknown."""
        # how training trees grow (evaluation: one greedy response per node); algorithms check theirs against it
        self.tree = TreeSettings(
            num_generations=hp.num_generations,
            joint_mode=joint_mode,
            cross_return=cross_return,
            num_turns=num_turns,
            sampling=self.sampling,
            early_termination_threshold=early_termination_threshold,
            chat_template=chat_template,
            reward_processor=RewardProcessor.parse(reward_processor),
            tools=tools,
        )
        self._warn_missing_prompt_field(num_turns)

    def _wrapped(self, centralized_adapter, parse_failure_reward, num_turns: int, branch):
        """The environment as the trees play it: a joint actor's (centralized), a game's branching."""
        env = self.env
        if centralized_adapter is not None:
            if num_turns > 1:
                raise ConfigError(
                    f"data.centralized_adapter: a joint actor plays one turn; data.num_turns={num_turns} must be 1"
                )
            adapter = import_object(centralized_adapter, "data.centralized_adapter")
            env = CentralizedEnv(env, adapter() if isinstance(adapter, type) else adapter, parse_failure_reward)
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
        return env

    def _reward_range(self, reward_range) -> tuple[float, float] | None:
        raw_range = check_range(reward_range, "data.reward_range")
        inner = self.env.inner if isinstance(self.env, CentralizedEnv) else self.env
        if raw_range is None and isinstance(inner, FunctionEnv):
            raw_range = check_range(getattr(inner.reward_fn, "reward_range", None), f"{inner.reward_name}.reward_range")
        return raw_range

    def _tools(self, tools: TreeTools, chat_template: bool, sampling_streams: str) -> TreeTools:
        """``data.tools`` checked against the rest of the settings, and saved with each function by its path."""
        if sampling_streams == "per_task":
            raise ConfigError(
                "data.sampling_streams=per_task with data.tools: a tool round's replies have no per-task stream yet; "
                "use data.sampling_streams: shared"
            )
        if not isinstance(self.env, TextEnv):
            raise ConfigError(
                f"data.tools: tools in a tree are a text environment's (a reward function and transition); "
                f"{type(self.env).__name__} is not one: play a game's tools in episodes (tool_mode: tools)"
            )
        if not chat_template:
            raise ConfigError("data.tools needs data.chat_template: true (the chat template renders the tools)")
        self.hparams["tools"] = tools.saved()
        return tools

    def agent_tools(self) -> tuple[tuple, str]:
        """``data.tools``' tools and parser (a tree's tools are the data module's, not the environment's)."""
        if self.tree.tools is not None:
            return self.tree.tools.tools, self.tree.tools.parser
        return super().agent_tools()

    def _warn_missing_prompt_field(self, num_turns: int) -> None:
        """A user's transition reads the task prompt (an env's own, or one marked like ``plain``, may not)."""
        env, field = self.env, self.call_settings.transition_prompt_field
        user_transition = isinstance(env, FunctionEnv) and env.has_transition
        user_transition = user_transition and getattr(env.transition_fn.func, "reads_task_prompt", True)
        lacking = [t for t in self.train_tasks + self.val_tasks if field not in t]
        if num_turns > 1 and user_transition and lacking:
            rank_zero_warn(
                f"data.reward_calls.transition_prompt_field={field!r}: {len(lacking)} task rows of "
                f"data.train_path / data.val_path have no such field (e.g. one with {sorted(lacking[0])}), so the "
                "transition's `prompt` argument is the empty string for them (CoMLRL's behaviour); set "
                "data.reward_calls.transition_prompt_field to the field that holds the task's prompt"
            )

    @property
    def num_generations(self) -> int:
        return self.tree.num_generations

    def prompts_for(self, tasks: list[dict]) -> list[list[str]]:
        return [state.observations for state in self.env.reset(tasks)]

    def rollout(self, agents, tasks: list[dict], greedy: bool, engine=None, stream: str = "policy") -> RolloutBatch:
        """``stream`` names the per-task sampling streams of the rollout (``sampling_streams: per_task``)."""
        settings = replace(self.tree, num_generations=1, sampling=self.sampling.as_greedy()) if greedy else self.tree
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
            on_reward_error=self.call_settings.on_reward_error,
            demos=len(self.demos),
            eval_tasks_per_step=self.hparams.eval_tasks_per_step,
            max_staleness=self.hparams.max_staleness,
        )

    def batch_stats(self, batch) -> dict:
        return batch.stats

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
        if self._skipped_steps >= self.call_settings.max_skipped_steps:
            raise RewardError(
                f"every reward of the last {self._skipped_steps} training steps was skipped "
                "(data.reward_calls.on_reward_error=skip: it raised, timed out or was NaN/inf for every sample), "
                "so nothing is being learned. Fix the reward "
                "(run it on a few samples by hand), or raise data.reward_calls.max_skipped_steps"
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
