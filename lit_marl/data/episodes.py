"""EpisodeDataModule: task rows in, multi-turn episodes out (``rollout/episode.py``), built on the
fly with the current policy, G episodes per task."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import Team
from lit_marl.data.base import Evaluated, TaskDataModule
from lit_marl.envs.alfworld.games import ALIASES as ALFWORLD_ALIASES
from lit_marl.fields import PositiveInt, check_fields
from lit_marl.rollout.episode import EpisodeSettings, run_episodes
from lit_marl.rollout.settings import RolloutSettings
from lit_marl.tasks import mixture


class EpisodeDataModule(TaskDataModule):
    """Task rows in, multi-turn episodes out: each agent plays its own dialogue with the environment
    (a game, or a text environment whose reward scores each turn), G episodes per task from the same
    start. Besides every data module's settings (``TaskDataModule``):

    Args:
        max_turns: Turns per episode; an episode still running after them is ``truncated``.
        max_context_tokens: Budget of a whole episode's sequence: when the next observation and a reply
            would not fit, the episode ends as ``truncated`` with what it earned.
        env_workers: Threads that step the environments of a turn in parallel.
        task_types: Train and evaluate only on rows of these task types (the rows' ``task_type``, e.g.
            ALFWorld's), training on them in equal shares: the rarer types' rows repeat so each type has as
            many as the most common (the guide's mixture experiment). None: every row as given. Evaluation
            reports the success of every task type either way.
        anchor: What makes two turns of a task's episodes one anchor state for step-level groups
            (``model.advantage.step_weight``): ``state``, the env's canonical state (TextWorld's and
            ALFWorld's facts, Corridor's room and items; the observation where an env has none);
            ``observation``, the agent's observation text.
        reasoning: ``think``: a reply's ``<think>...</think>`` block is the agent's reasoning (Qwen3): the env
            acts on the text after it (nothing while unclosed); trained on whole either way. ``none``: all of it.
        history: For chat templates that rewrite earlier turns (Qwen3's think blocks): ``verbatim`` keeps each
            reply as generated in the context (exact training; a warning); ``strict`` refuses such templates.
        turns: ``lockstep``: turn t of every live episode is one batched generation and one environment step,
            so an episode waits for the slowest of the turn. ``independent``: each episode plays its own turns,
            its next request sent as soon as its environment has stepped (the server batches whatever is in
            flight); each request seeded by episode, agent and turn, so the rollout does not depend on the order
            replies arrive in. Needs an engine that generates off the trainer's devices (``vllm_server``), and
            an environment whose ``step`` may run for several episodes at once, up to ``env_workers`` (games:
            each its own instance; a text environment: its reward function and transition from several threads).
    """

    def __init__(
        self,
        max_turns: PositiveInt = 8,
        max_context_tokens: PositiveInt = 2048,
        env_workers: PositiveInt = 8,
        task_types: list[str] | None = None,
        anchor: Literal["state", "observation"] = "state",
        reasoning: Literal["none", "think"] = "none",
        history: Literal["verbatim", "strict"] = "verbatim",
        turns: Literal["lockstep", "independent"] = "lockstep",
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_fields("data", EpisodeDataModule.__init__, locals())
        hp = self.hparams
        if max_context_tokens <= self.sampling.max_new_tokens:
            raise ConfigError(
                f"data.max_context_tokens={max_context_tokens}: must exceed data.sampling.max_new_tokens="
                f"{self.sampling.max_new_tokens}"
            )
        if turns == "independent" and not self.engine.remote:
            raise ConfigError(
                f"data.turns=independent: data.engine={self.engine.name} generates one batch at a time on the "
                "trainer's devices, so an episode on its own would decode alone; use data.engine: vllm_server "
                "(requests of every episode in flight at once), or data.turns: lockstep"
            )
        if task_types:
            self._keep_types([ALFWORLD_ALIASES.get(kind, kind) for kind in task_types])  # ALFWorld's short names
        self.num_generations = hp.num_generations
        # how training episodes are played (evaluation: one greedy episode per task)
        self.episode = EpisodeSettings(
            group_size=hp.num_generations,
            max_turns=max_turns,
            max_context_tokens=max_context_tokens,
            sampling=self.sampling,
            anchor=anchor,
            reasoning=reasoning,
            history=history,
            turns=turns,
        )
        self.env.pool = ThreadPoolExecutor(max_workers=env_workers)

    def _keep_types(self, task_types: list[str]) -> None:
        """Train on the rows of ``task_types`` in equal shares, evaluate on theirs."""
        self.train_tasks = mixture(self.train_tasks, task_types, "data.task_types (train rows)")
        if self.val_tasks:  # held-out games are played once each: filtered, not repeated
            self.val_tasks = [row for row in self.val_tasks if row.get("task_type") in task_types]
            held_out = {row["task_type"] for row in self.val_tasks}
            if held_out != set(task_types):
                raise ConfigError(
                    f"data.task_types={task_types}: data.val_path holds no rows of {sorted(set(task_types) - held_out)}"
                )
        if self.demos:  # the SFT phase is the same mixture (rows without a type are kept)
            self.demos = [d for d in self.demos if (d.get("task_type") or task_types[0]) in task_types]

    def rollout(self, agents, tasks: list[dict], greedy: bool, group_size: int | None = None):
        """One batch per agent, each turn's rewards the env's (a game's: the team's outcome). Greedy:
        one episode per task; else ``group_size`` (default ``num_generations``) sampled ones."""
        settings = replace(self.episode, group_size=1, sampling=self.sampling.as_greedy()) if greedy else self.episode
        if group_size is not None and not greedy:
            settings = replace(settings, group_size=group_size)
        return run_episodes(list(agents), tasks, self.env, settings, self.engine)

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
            eval_tasks_per_step=self.hparams.eval_tasks_per_step,
            max_staleness=self.hparams.max_staleness,
        )

    def batch_stats(self, batch) -> dict:
        return batch[0].stats  # the agents' batches share one stats dict

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
