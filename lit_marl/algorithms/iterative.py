"""Iterative MADPO: the policy's candidates against a comparator's, pairs refreshed every step,
replayed across iterations (CoMLRL's ``MADPOIterTrainer``).

Each training step the data module rolls the step's tasks out twice, K joint candidates each: by
the current policy and by the comparator (``comparator_team``). Candidate k of the policy is paired
with candidate k of the comparator (``rollout/pairs.py: comparison_pairs``; the higher joint reward
is chosen, ties give none), the pairs are written to the iteration's replay shard
(``rollout/replay.py``), and the step trains MADPO's joint DPO loss on its new pairs or on a sample
of recent iterations' pairs. An iteration is ``steps_per_iteration`` steps; the run ends after
``num_iterations``.

Comparators (``comparator_policy``):

- ``current``: the current weights, sampling with their own random stream (saved in checkpoints),
  so the policy's own samples are those MADPO would draw;
- ``current_copy``: the policy as it was when this iteration began, frozen for the iteration (the
  weights CoMLRL's comparator has: it samples a whole iteration's pairs before training on them);
- ``history``: the policy ``comparator_history_k`` iterations back (k = 1 is ``current_copy``),
  from the per-iteration snapshots of the trainable weights in ``policy_checkpoint_dir``
  (LoRA: the adapters only); before the first iterations, the initial policy;
- ``model``: other models (``comparator_model``), frozen; they must share the policy's tokenizer;
- ``api``: an HTTP endpoint (``comparator_api``: ``generation/api.py``), texts tokenized by the policy.

``comparator_generation_mode`` (``generation/text.py``): ``decentralized`` (each role's own model;
the comparator's own tokens become rows), ``centralized`` or ``centralized_sequential`` (one writer
for every role through an adapter; texts re-tokenized by the policy against its own prompts).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lit_marl import ConfigError
from lit_marl.agents import Agent
from lit_marl.algorithms.madpo import MADPO
from lit_marl.fields import ClosedUnitInterval, NonNegativeInt, PositiveInt, check_fields
from lit_marl.generation.api import ApiSettings, ApiWriter
from lit_marl.generation.text import GenerationMode, ModelWriter, TextEngine, TextRole
from lit_marl.metrics import Timer
from lit_marl.models import prepare_models, store_frozen
from lit_marl.rollout.batch import RolloutBatch
from lit_marl.rollout.pairs import comparison_rows
from lit_marl.rollout.replay import PreferenceReplay, ReplayMode, ReplaySettings
from lit_marl.tasks import import_object

ComparatorPolicy = Literal["current", "current_copy", "history", "model", "api"]


@dataclass
class Comparator:
    """What the data module rolls the comparator's candidates with; ``checked`` marks the joint
    candidates a text comparator could not give (a timeout, an unparseable text) so that they form no pair."""

    agents: list
    engine: TextEngine | None = None

    def checked(self, batch: RolloutBatch) -> RolloutBatch:
        if self.engine is None:
            return batch
        rows = sorted({row for skipped in self.engine.skipped.values() for row in skipped})
        shaped = batch.levels.shaped[0].clone()  # aligned, single turn: row r of every agent is joint candidate r
        shaped.view(-1, shaped.shape[-1])[rows] = float("nan")  # their returns: NaN, no pair
        batch.levels.shaped[0] = shaped
        batch.metrics["comparator_skipped"] = float(len(rows))
        batch.metrics["comparator_candidates"] = float(len(batch.agents[0]))
        return batch


def check_comparator(settings: dict, num_agents: int | None) -> None:
    """The comparator settings (``IterativeMADPO``'s arguments) that belong together (with the team's
    size once it is known)."""
    policy, history_k = settings["comparator_policy"], settings["comparator_history_k"]
    model, api = settings["comparator_model"], settings["comparator_api"]
    mode, centralized_index = settings["comparator_generation_mode"], settings["comparator_centralized_agent_index"]
    if (history_k is not None) != (policy == "history"):
        raise ConfigError(
            f"model.comparator_history_k={history_k} belongs to comparator_policy: history (the policy is {policy!r})"
        )
    if (model is not None) != (policy == "model"):
        raise ConfigError("model.comparator_model is needed by, and only by, model.comparator_policy: model")
    if (api is not None) != (policy == "api"):
        raise ConfigError("model.comparator_api is needed by, and only by, model.comparator_policy: api")
    if num_agents is None:
        return
    if centralized_index >= num_agents:
        raise ConfigError(
            f"model.comparator_centralized_agent_index={centralized_index}: there are {num_agents} agents (0-based)"
        )
    if mode == "centralized_sequential" and num_agents < 2:
        raise ConfigError("model.comparator_generation_mode=centralized_sequential needs 2 agents or more")


class IterativeMADPO(MADPO):
    """MADPO on pairs of the policy's candidates against a comparator's, with preference replay."""

    comparator = True
    """Its pairs are the policy's candidates against the comparator's (``model.pairs.selection``)."""

    def __init__(
        self,
        num_iterations: PositiveInt = 4,
        steps_per_iteration: PositiveInt = 1,
        comparator_policy: ComparatorPolicy = "current",
        comparator_history_k: PositiveInt | None = None,
        comparator_model: str | list[str] | None = None,
        comparator_api: ApiSettings | None = None,
        comparator_generation_mode: GenerationMode = "decentralized",
        comparator_centralized_agent_index: NonNegativeInt = 0,
        comparator_adapter: str = "lit_marl.envs.centralized:TaggedAdapter",
        max_skipped_comparator_steps: PositiveInt = 3,
        preference_replay_mode: ReplayMode = "current",
        preference_replay_k: PositiveInt | None = None,
        preference_replay_lambda: ClosedUnitInterval | None = None,
        preference_replay_sample_size: PositiveInt | None = None,
        preference_replay_dir: str | None = None,
        policy_checkpoint_dir: str | None = None,
        **kwargs,
    ):
        """
        Args:
            num_iterations: Iterations of the run (CoMLRL's default 4); it stops after the last.
            steps_per_iteration: Training steps per iteration: the unit of ``history`` and of the replay shards.
            comparator_policy: Who the policy's candidates are compared with: ``current``, ``current_copy``,
                ``history``, ``model`` or ``api`` (module docstring).
            comparator_history_k: ``history`` only: how many iterations back (default 1).
            comparator_model: ``model`` only: the comparator's model source, or one per agent.
            comparator_api: ``api`` only: the endpoint (``url``, ``format``: generic / openai_chat /
                anthropic, ``model``, ``timeout_s``, ``key_env``, ...: ``lit_marl.generation.api.ApiSettings``).
            comparator_generation_mode: ``decentralized`` (each role by its own model), ``centralized`` (one
                model or endpoint writes every role in one text, split by the adapter) or
                ``centralized_sequential`` (roles in order, each seeing the earlier roles' outputs):
                ``lit_marl/generation/text.py``.
            comparator_centralized_agent_index: ``centralized``: which role's comparator model writes (api: the
                ``agent_idx`` sent).
            comparator_adapter: ``centralized`` modes: import path of the adapter (``build_prompt`` /
                ``parse_completion``, ``build_sequential_prompt`` / ``parse_sequential_completion``).
            max_skipped_comparator_steps: Stop after this many steps in a row with every comparator candidate skipped.
            preference_replay_mode: ``current`` (each step's new pairs), ``nearest_k``, ``all_history`` or
                ``lambda_decay`` (a sample of recent iterations' pairs: ``lit_marl/rollout/replay.py``).
            preference_replay_k: ``nearest_k`` only: the newest k iterations (the current one included).
            preference_replay_lambda: ``lambda_decay`` only: an iteration of age a weighs (1 - l) l^a.
            preference_replay_sample_size: Pairs a replay step trains on (default: as many as the step's new pairs).
            preference_replay_dir: Folder of the replay shards (default: ``<log dir>/preference_replay``).
            policy_checkpoint_dir: Folder of the per-iteration snapshots for ``history`` / ``current_copy``
                (default: ``<log dir>/policy_history``).
            **kwargs: MADPO's and the team's settings (dpo_beta, dpo_reference, pairs, model, lora, ...): ``pairs``
                are the policy's candidates against the comparator's, index by index (``comparator_reward``
                first by default; CoMLRL caps them at 4 per task).
        """
        super().__init__(candidate_policy="current", **kwargs)
        check_fields("model", IterativeMADPO.__init__, locals())
        self.replay_settings = ReplaySettings(
            preference_replay_mode, preference_replay_k, preference_replay_lambda, preference_replay_sample_size
        )
        self.comparator_settings = {k: v for k, v in locals().items() if k.startswith("comparator_")}
        check_comparator(self.comparator_settings, len(self.sources) if self.sources else None)
        self.num_iterations, self.steps_per_iteration = num_iterations, steps_per_iteration
        self.comparator_policy = comparator_policy
        self.history_k = 1 if comparator_policy == "current_copy" else comparator_history_k
        self.comparator_model = comparator_model
        self.comparator_api = ApiSettings(**comparator_api) if isinstance(comparator_api, dict) else comparator_api
        self.generation_mode, self.centralized_index = comparator_generation_mode, comparator_centralized_agent_index
        adapter = import_object(comparator_adapter, "model.comparator_adapter")
        self.adapter = adapter() if isinstance(adapter, type) else adapter
        self.max_skipped_comparator_steps, self._skipped_comparator_steps = max_skipped_comparator_steps, 0
        self.replay_dir, self.snapshot_dir = preference_replay_dir, policy_checkpoint_dir
        self.steps_done = 0
        self.comparator_rng = torch.Generator().manual_seed(torch.initial_seed() + 1).get_state()
        self.comparator_cuda_rng: torch.Tensor | None = None
        self.snapshots: list[str] = []  # snapshot n: the trainable weights after n iterations
        self._frozen: dict[str, object] = {}  # the comparator's models, kept out of the module's state
        self.replay: PreferenceReplay | None = None

    def size_team(self, num_agents: int) -> None:
        super().size_team(num_agents)
        check_comparator(self.comparator_settings, num_agents)

    @property
    def comparator_sources(self) -> list[str] | None:
        """Each role's comparator model (``comparator_policy: model``)."""
        model = self.comparator_model
        return [model] * len(self.sources) if isinstance(model, str) else model

    @property
    def iteration(self) -> int:
        return self.steps_done // self.steps_per_iteration

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        if self.comparator_policy in ("current_copy", "history") and self.shards is not None:
            raise ConfigError(
                f"model.comparator_policy={self.comparator_policy} keeps a copy of the team, which FSDP shards do not "
                "allow here: use trainer.strategy: ddp, or comparator_policy: current / model / api"
            )
        self.rollout_settings.require("tree", "IterativeMADPO", "needs the comparator's rollout")
        engine = self.rollout_settings.engine
        if engine.name == "vllm" and self.comparator_policy not in ("current", "api"):
            raise ConfigError(
                f"model.comparator_policy={self.comparator_policy} generates with other weights than the policy's, "
                "which the vllm engine does not hold: use data.engine: auto (or comparator_policy: current / api)"
            )
        root = Path(self.trainer.log_dir or self.trainer.default_root_dir)
        # absolute: the checkpoint lists the files, and a resumed run may start elsewhere
        self.replay_dir = str(Path(self.replay_dir or root / "preference_replay").resolve())
        self.snapshot_dir = str(Path(self.snapshot_dir or root / "policy_history").resolve())
        self._make_replay()

    def configure_model(self) -> None:
        super().configure_model()
        self._make_replay()

    def _make_replay(self) -> None:
        """Once the folders (``setup``) and the agents' tokenizers (``configure_model``) are known."""
        if self.replay is None and self.replay_dir is not None and self.agents is not None:
            pad_ids = [agent.pad_token_id for agent in self.agents]
            self.replay = PreferenceReplay(self.replay_dir, self.global_rank, self.replay_settings, pad_ids)

    # ------------------------------------------------------------------ the comparator
    @contextmanager
    def comparator_team(self, tasks: list[dict]):
        """The comparator's agents for the data module's second rollout, sampling with the
        comparator's own random stream (the policy's stream is left as it was)."""
        if self.comparator_policy == "api":
            team = None
        elif self.comparator_policy == "current":
            team = list(self.agents)
        elif self.comparator_policy == "model":
            if "team" not in self._frozen:
                self._frozen["team"] = self._load_comparator_models()
            team = self._frozen["team"]
        else:
            team = self._snapshot_team()
        engine = None
        if team is None or self.generation_mode != "decentralized":  # texts, as rows of the policy
            writer = ApiWriter(self.comparator_api) if team is None else ModelWriter(team, self.rollout_settings.engine)
            engine = TextEngine(writer, self.generation_mode, self.adapter, self.centralized_index)
            team = [TextRole(agent, i, tasks) for i, agent in enumerate(self.agents)]
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(self.comparator_rng)
            if cuda:
                if self.comparator_cuda_rng is None:
                    torch.cuda.manual_seed(torch.initial_seed() + 1)
                else:
                    torch.cuda.set_rng_state(self.comparator_cuda_rng)
            yield Comparator(team, engine)
            self.comparator_rng = torch.get_rng_state()
            self.comparator_cuda_rng = torch.cuda.get_rng_state() if cuda else None

    def _load_comparator_models(self) -> list[Agent]:
        """Frozen agents of ``comparator_model``: one per distinct source, each playing its roles."""
        loaded: dict[str, Agent] = {}
        for role, source in enumerate(self.comparator_sources):
            if source not in loaded:
                loaded[source] = Agent(source, None, self.system_prompt).requires_grad_(False).to(self.device)
                prepare_models(loaded[source], False, self.memory.weights_dtype)
            policy, theirs = self.agents[role].tokenizer, loaded[source].tokenizer
            if policy.get_vocab() != theirs.get_vocab() or policy.chat_template != theirs.chat_template:
                raise ConfigError(
                    f"model.comparator_model={source!r} has another tokenizer or chat template than agent {role}'s "
                    f"model ({self.sources[role]!r}): a pair's two responses must be tokens of one vocabulary"
                )
        return [loaded[source] for source in self.comparator_sources]

    def _snapshot_team(self) -> list[Agent]:
        """The team with the weights of snapshot max(n + 1 - k, 0) in iteration n; snapshots are
        taken as each iteration begins (rank 0 writes, every rank reads)."""
        if self.steps_done % self.steps_per_iteration == 0 and len(self.snapshots) <= self.iteration:
            path = Path(self.snapshot_dir) / f"iteration_{self.iteration:04d}.pt"
            if self.global_rank == 0:
                path.parent.mkdir(parents=True, exist_ok=True)
                trainable = {n: p.detach().cpu() for n, p in self.agents.named_parameters() if p.requires_grad}
                torch.save(trainable, path.with_suffix(".pt.partial"))
                path.with_suffix(".pt.partial").replace(path)
            self.trainer.strategy.barrier("policy snapshot")
            self.snapshots.append(str(path))
        wanted = max(self.iteration + 1 - self.history_k, 0)
        if "copy" not in self._frozen:
            self._frozen["copy"] = copy.deepcopy(self.agents).requires_grad_(False)
            store_frozen(self._frozen["copy"], self.memory.weights_dtype)
        if self._frozen.get("loaded") != wanted:
            state = torch.load(self.snapshots[wanted], weights_only=True, map_location=self.device)
            unknown = self._frozen["copy"].load_state_dict(state, strict=False).unexpected_keys
            if unknown:
                raise ConfigError(f"the snapshot {self.snapshots[wanted]} holds weights this team lacks: {unknown[:3]}")
            self._frozen["loaded"] = wanted
        return list(self._frozen["copy"])

    # ------------------------------------------------------------------ the step
    def rl_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        if batch.comparator is None:
            raise ConfigError(
                "IterativeMADPO needs the comparator's rollout: use data: lit_marl.data.RolloutDataModule"
            )
        self._check_skipped(batch.comparator.metrics)
        pad_ids = [agent.pad_token_id for agent in self.agents]
        with Timer() as train_time, self.computing(update=True):
            fresh, without = comparison_rows(
                batch, batch.comparator, self.pair_settings, self.shuffle_generator, pad_ids
            )
            self.replay.write(self.iteration, self.steps_done, fresh)
            pairs = self.replay.draw(self.iteration, fresh, self.shuffle_generator)
            agents = pairs.agents if len(pairs) else batch.agents  # no pair: the step still joins every rank's update
            self.dpo_update(agents, pairs.chosen, pairs.rejected, pairs.gaps)
        if len(fresh):
            self.record({"iter/target_win_rate": float(fresh.target_wins.float().mean())}, weight=len(fresh))
        comparator_rewards = batch.comparator.rewards
        self.record({"iter/comparator_reward": float(comparator_rewards[comparator_rewards.isfinite()].mean())})
        counts = {"iter/new_pairs": float(len(fresh)), "train/tasks_without_pairs": float(without)}
        if "comparator_skipped" in batch.comparator.metrics:  # a text comparator's timeouts, unparseable texts
            counts["iter/comparator_skipped"] = batch.comparator.metrics["comparator_skipped"]
        self.record(counts, reduce="sum")
        timings = {
            "perf/train_s": train_time.seconds,
            "perf/comparator_generate_s": batch.comparator.stats["perf/generate_s"],
        }
        self.record({"iter/iteration": float(self.iteration), **timings})
        self.log_rollout(batch, "train")
        self.steps_done += 1
        if self.steps_done >= self.num_iterations * self.steps_per_iteration:
            self.trainer.should_stop = True

    def _check_skipped(self, metrics: dict) -> None:
        """Stop a run whose comparator gives nothing to compare, step after step (this rank's count)."""
        skipped = metrics.get("comparator_skipped", 0.0)
        everything = skipped > 0 and skipped == metrics["comparator_candidates"]
        self._skipped_comparator_steps = self._skipped_comparator_steps + 1 if everything else 0
        if self._skipped_comparator_steps >= self.max_skipped_comparator_steps:
            raise RuntimeError(
                f"the comparator gave no usable candidate in the last {self._skipped_comparator_steps} steps "
                "(every request timed out or was refused, or no text could be parsed by "
                f"{type(self.adapter).__name__}): check model.comparator_api (url, timeout_s) or the "
                "comparator's output format, or raise model.max_skipped_comparator_steps"
            )

    # ------------------------------------------------------------------ resume
    def rank_state(self) -> dict:
        return {
            "steps_done": self.steps_done,
            "comparator_rng": self.comparator_rng,
            "comparator_cuda_rng": self.comparator_cuda_rng,
            "snapshots": list(self.snapshots),
            "replay": self.replay.state_dict(),
        }

    def load_rank_state(self, state: dict) -> None:
        """The iteration, the comparator's random stream, its snapshots and the replay shards."""
        if "steps_done" not in state:
            raise ConfigError("the checkpoint is not an IterativeMADPO run's: resume with the algorithm that wrote it")
        self.steps_done, self.comparator_rng = state["steps_done"], state["comparator_rng"]
        self.comparator_cuda_rng = state["comparator_cuda_rng"]
        self.snapshots = list(state["snapshots"])
        missing = [p for p in self.snapshots if not Path(p).is_file()]
        if missing:
            raise ConfigError(
                f"the checkpoint's policy snapshots are missing: {missing[:3]}: restore model.policy_checkpoint_dir"
            )
        self._frozen.pop("loaded", None)
        self.replay.load_state_dict(state["replay"])
