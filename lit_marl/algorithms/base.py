"""What every algorithm shares: a team of agents, one optimizer per agent, manual optimization
over micro-batches, and logging of rollouts. Algorithms add their loss."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lit_marl import ConfigError, checkpoint_files, cpu
from lit_marl.agents import Agent, LoraSettings, Team, roles_by_model, team_sources
from lit_marl.algorithms.references import build_reference_adapters, reference_adapter, take_policy
from lit_marl.algorithms.settings import MemorySettings
from lit_marl.algorithms.updates import OptimizerSteps
from lit_marl.callbacks.progress import RunProgressBar
from lit_marl.fields import (
    ClosedUnitInterval,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    as_group,
    check_fields,
    saved_groups,
)
from lit_marl.logprobs import sft_loss
from lit_marl.memory import check_memory, fsdp_settings
from lit_marl.metrics import StepLogging, Timer
from lit_marl.models import (
    AttentionKernel,
    built_empty,
    frozen_copy,
    prepare_models,
    set_attention,
)
from lit_marl.parallel.collectives import all_ranks_max, gather_objects, to_cpu
from lit_marl.parallel.fsdp import TeamShards, check_shardable, load_from_rank0, shardable_models
from lit_marl.parallel.strategies import TeamDDPStrategy
from lit_marl.rollout.batch import AgentSamples, RolloutBatch
from lit_marl.rollout.buffer import RolloutBuffer
from lit_marl.rollout.demos import DemoSamples


class AgentTeamModule(OptimizerSteps, StepLogging, L.LightningModule):
    """The base of every algorithm family: the team (agents, learners that own their weights,
    references), one optimizer per learner (manual optimization), the SFT step, checkpoint state,
    logging. A family adds ``rl_step(batch)`` in one vocabulary: ``prepare`` (the behaviour policy's
    log-probs and values of the rows), ``advantages(samples, ...)`` (the rows with their advantages
    and what comes with them: TD targets, returns), ``loss(samples, stats, learner)`` (one learner's
    loss on a micro-batch, summed over rows; ``stats`` gathers diagnostics), run through
    ``update_agent`` one optimizer step at a time."""

    def __init__(
        self,
        model: str | list[str] = "tiny-random",
        num_agents: PositiveInt | None = None,
        lora: LoraSettings | None = None,
        system_prompt: str | None = None,
        learning_rate: PositiveFloat = 1e-5,
        max_grad_norm: NonNegativeFloat = 1.0,
        weight_decay: NonNegativeFloat = 0.0,
        share_parameters: bool = False,
        lora_shared_base: bool = False,
        max_nonfinite_steps: NonNegativeInt = 0,
        log_samples_every_n_steps: NonNegativeInt = 10,
        attn_implementation: AttentionKernel | None = None,
        memory: MemorySettings = MemorySettings(),
        discount: ClosedUnitInterval = 1.0,
        kl_reference: Literal["base", "rl_start"] = "base",
    ):
        """
        Args:
            model: Model source of every agent (each gets its own copy of the weights), or one source
                per agent: ``tiny-random``, ``smollm2-135m-instruct``, an HF id or a local folder.
            num_agents: Number of agents (the CLI links it to the data's); None: one per source of a list
                ``model``, else the data's, taken when the run starts (a script need not give it).
            lora: LoRA adapters per agent instead of full fine-tuning (omit for full fine-tuning).
            system_prompt: System message for every agent (omit to keep the chat template's default).
            learning_rate: AdamW learning rate of every agent.
            max_grad_norm: Gradient norm clipping per agent, a critic's apart from its policy's (0 disables).
            weight_decay: AdamW's decoupled weight decay (CoMLRL's: torch's default 0.01); 0: none.
            share_parameters: One model plays every role (one set of weights, one optimizer, one
                batched generate per turn for all roles); needs one model source.
            lora_shared_base: With ``lora``, every agent is an adapter on ONE frozen copy of the base
                (memory of one model plus the adapters); the agents still learn separately, each
                with its own adapter and optimizer. Needs one model source.
            max_nonfinite_steps: What a NaN/inf loss or gradient does: 0 (default) stops the run at
                once; n > 0 skips up to n such optimizer steps over the run (the weights and the
                optimizer state untouched; ``train/nonfinite_skips`` counts them) and stops at the
                next. Never is a non-finite value applied to the weights.
            log_samples_every_n_steps: Every n training steps (the first included) one whole joint tree or
                episode, each branch's reward shown, to TensorBoard's text tab, rewards and advantages to histograms.
            attn_implementation: transformers' attention kernel (None: ``sdpa``); ``eager`` with ``trainer.precision:
                bf16-mixed`` on CPU, where sdpa's bf16 backward is slow (docs/quickstart.md).
            memory: What the passes and the stored weights hold (``algorithms.settings.MemorySettings``): tokens
                and rows per forward/backward pass, activation checkpointing, the frozen weights' dtype, the check.
            discount: Gamma between turns: tree returns (r + gamma x the child node's mean return), TD targets,
                episode returns and GAE; 1.0 (CoMLRL's, and the practitioner guide's finding).
            kl_reference: A KL term's reference: ``base`` (as loaded) or ``rl_start`` (as RL starts: veRL's).
        """
        super().__init__()
        check_fields("model", AgentTeamModule.__init__, locals())
        self.nonfinite_skips, self.reference_adapters = 0, False  # reference_adapters: build_references
        num_agents = num_agents or (None if isinstance(model, str) else len(model))
        team_sources(model, num_agents or 1, share_parameters, lora is not None, lora_shared_base)  # fail first
        self.save_hyperparameters()
        self.sources, self.rollout_buffers = None, []  # per agent, once the team's size is known: size_team
        if num_agents is not None:
            AgentTeamModule.size_team(self, num_agents)  # the base part: subclasses are not set up yet
        self.lora, self.system_prompt = LoraSettings(**lora) if isinstance(lora, dict) else lora, system_prompt
        self.share_parameters, self.lora_shared_base = share_parameters, lora_shared_base
        self.attn_implementation, self.discount = attn_implementation, discount
        self.memory = as_group(MemorySettings, memory)
        saved_groups(self, memory=self.memory)
        self.weight_decay, self.kl_reference, self.automatic_optimization = weight_decay, kl_reference, False
        self.agents = self.references = self.shards = self.rollout_settings = None  # built by configure_model
        self.shuffle_generator = torch.Generator().manual_seed(torch.initial_seed() % 2**63)  # batch order, own RNG

    def configure_model(self) -> None:
        # loads weights: kept out of __init__ so bad configs fail first. Sharded over several ranks,
        # only rank 0 reads them; the others build empty models and receive their shards (``shard``)
        sharding = self.device_mesh is not None and self.shards is None  # ModelParallelStrategy: FSDP2
        with built_empty() if sharding and self.global_rank != 0 else nullcontext():
            self.build_models()
        prepare_models(self, self.memory.activation_checkpointing, self.memory.weights_dtype)
        if sharding:
            self.shard(self.device_mesh)

    buffered = False
    """Whether the algorithm keeps one rollout buffer per agent (``rollout_buffers``)."""

    def size_team(self, num_agents: int) -> None:
        """The team's size, given or taken from the data: every agent's source, its buffer."""
        hp = self.hparams
        self.hparams.num_agents = num_agents
        self.sources = team_sources(hp.model, num_agents, hp.share_parameters, hp.lora is not None, hp.lora_shared_base)
        self.rollout_buffers = [RolloutBuffer() for _ in range(num_agents)] if self.buffered else []

    def configure_callbacks(self):
        """Lightning's default bar (a plain rich bar, never one a user configured) becomes the run's
        bar (``RunProgressBar``: steps, phase and budget) in Python scripts too; the CLI swaps it first."""
        default = [c for c in self.trainer.callbacks if type(c) is RichProgressBar]
        return [RunProgressBar()] if default else []

    def on_fit_start(self) -> None:
        # the agents stay in eval mode on purpose (no dropout: training scores the very policy that
        # sampled); Lightning's warning about it assumes supervised training
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
        if self.rollout_settings is not None:  # what the engine would refuse at the first rollout
            self.rollout_settings.engine.check_team(list(self.agents), self.device.type)
            self.rollout_settings.check_overlap(self)
        if self.memory.check:
            check_memory(self, self.rollout_settings)
        if self.kl_reference == "rl_start" and (self.shards is not None or not self.has_reference):
            why = "under FSDP (not supported yet)" if self.shards is not None else "without a KL term (kl.coef: 0)"
            raise ConfigError(f"model.kl_reference: rl_start {why}: leave kl_reference out, or set model.kl.coef > 0")
        if self.phase == "rl" and self.trainer.ckpt_path is None:  # resumed: the checkpoint holds the reference
            self.start_rl()

    @property
    def has_reference(self) -> bool:
        return self.references is not None or self.reference_adapters

    def build_models(self) -> None:
        """Every model of the algorithm not built yet (agents here; critics, references in subclasses)."""
        if self.agents is not None:
            return
        if self.sources is None:
            raise ConfigError(
                "model.num_agents: the team's size comes from the data when a run starts; give num_agents to build "
                "the models before that"
            )
        if self.share_parameters:
            shared = Agent(self.sources[0], self.lora, self.system_prompt)
            self.agents = nn.ModuleList([shared] * len(self.sources))
        elif self.lora_shared_base:
            team = Agent.team_on_shared_base(self.sources[0], self.lora, len(self.sources), self.system_prompt)
            self.agents = nn.ModuleList(team)
        else:
            self.agents = nn.ModuleList(Agent(s, self.lora, self.system_prompt) for s in self.sources)
        set_attention([agent.model for agent in self.agents], self.attn_implementation)

    def build_references(self) -> None:
        """The KL reference of each learner (``kl_reference``): a frozen copy of its initial weights;
        with LoRA none is copied: the base with the adapters disabled, or at ``rl_start`` a frozen
        second adapter (``reference_model``)."""
        if self.lora is None and self.references is None:  # stored in memory.weights_dtype from the start
            self.references = nn.ModuleList(
                frozen_copy(self.model_of(i), self.memory.weights_dtype) for i in range(len(self.learners))
            )
        elif self.lora is not None and self.kl_reference == "rl_start":
            build_reference_adapters([self.model_of(i) for i in range(len(self.learners))])
            self.reference_adapters = True

    def start_rl(self) -> None:
        """RL starts with the weights as they are now (``PhaseSwitch`` at the switch; a run that starts
        in RL, when it starts): a reference at ``rl_start`` takes them."""
        if self.kl_reference == "rl_start":
            take_policy(self)

    @contextmanager
    def reference_model(self, learner: int) -> Iterator[nn.Module]:
        """The reference policy of ``learner`` for the block: its frozen copy, or its model with the adapters off."""
        if self.references is not None:
            yield self.references[learner]
            return
        model = self.model_of(learner)
        if self.reference_adapters:  # kl_reference: rl_start under LoRA
            with reference_adapter(model) as peft:
                yield peft
            return
        with model.disable_adapter():
            yield model

    @contextmanager
    def initial_team(self) -> Iterator[list[Agent]]:
        """The team with every learner's reference weights (``reference_model``) for the block: the
        same agents with their adapters off under LoRA, else agents around the frozen copies."""
        if self.reference_adapters and self.lora_shared_base and len(self.learners) > 1:
            raise ConfigError("kl_reference: rl_start with lora_shared_base: one base cannot hold every agent's "
                              "reference adapter active at once; use kl_reference: base or separate bases")  # fmt: skip
        with ExitStack() as stack:
            team = []  # one agent per learner: a shared model still plays its roles as one
            for n, roles in enumerate(self.learners):
                agent, model = self.agents[roles[0]], stack.enter_context(self.reference_model(n))
                kept = model is agent.model
                team.append(agent if kept else Agent(agent.source, None, agent.system_prompt, (model, agent.tokenizer)))
            yield [team[self.learner_of(role)] for role in range(len(self.agents))]

    overlaps_rollouts = True
    """Training rollouts sample the current agents alone: one may be generated during the update
    (``data.max_staleness``)."""

    def team(self) -> Team:
        """What this module hands the data module for a step (the one handshake at run time)."""
        computing = lambda engine: self.computing(rollout=engine)  # noqa: E731
        return Team(self.phase, list(self.agents or []), self.rollout_team, self.comparator_team, computing)

    @contextmanager
    def rollout_team(self) -> Iterator[nn.ModuleList | list[Agent]]:
        """The agents that sample training rollouts: the current ones (an algorithm may choose others)."""
        yield self.agents

    @contextmanager
    def comparator_team(self, tasks: list[dict]) -> Iterator[None]:
        """A second rollout of the same tasks by a comparator (iterative preference training): none here."""
        yield None

    def shard(self, mesh) -> None:
        """FSDP2 over ``mesh``: every model sharded where it was built (rank 0: the loaded weights on the
        host; the others: empty on the meta device), then rank 0's weights broadcast tensor by tensor,
        each rank keeping its shard (``load_from_rank0``): no rank holds a whole model on the device."""
        check_shardable(self, mesh)
        models = shardable_models(self)
        loaded = [model.state_dict() for model in models] if self.global_rank == 0 else [{} for _ in models]
        mode, gather_dtype = fsdp_settings(self, self.trainer.strategy, mesh["data_parallel"].size())
        self.shards = TeamShards(models, mesh["data_parallel"], mode, gather_dtype)
        load_from_rank0(self, models, loaded, self.trainer.strategy.root_device)

    def computing(self, update: bool = False, rollout=None) -> ExitStack:
        """Passes outside Lightning's steps as inside them: the trainer's precision, and under FSDP what
        the block's passes need whole. The gathered mode: every model (``TeamShards.gathered``). Per
        layer: nothing for an ``update`` (its passes gather layer by layer, in lockstep); for a rollout
        by the ``rollout`` engine, the models it generates with (``generation_models``), or none when
        the engine serves its own copy (vLLM gathers each weight as it syncs). References and critics
        are never gathered whole per layer: they are scored in the update's lockstep passes."""
        stack = ExitStack()
        if self.shards is not None:
            if update:
                stack.enter_context(self.shards.updating())
            elif not self.per_layer_fsdp:
                stack.enter_context(self.shards.gathered())
            else:
                own = rollout is not None and rollout.own_weights
                stack.enter_context(self.shards.gathered([] if own else self.shards.roots_in(self.generation_models())))
        if self._trainer is not None:
            stack.enter_context(self.trainer.precision_plugin.forward_context())
        return stack

    def generation_models(self) -> list[nn.Module]:
        """The models a rollout generates with: the agents' (an algorithm that samples from others,
        e.g. the initial weights, adds them). Under per-layer FSDP only these are gathered whole for
        a rollout, and only when no engine serves them from its own copy."""
        return [agent.model for agent in self.agents or []]

    def passes(self, rows, models: list[nn.Module], backward: bool = False, shared_prompts: bool = False):
        """The forward(/backward) passes of one loop over ``rows`` (``micro_batches``), each of
        ``models`` forwarded once per pass; under per-layer FSDP padded to the most any rank runs
        (``TeamShards.lockstep``: every rank must run the same loops)."""
        chunks = self.micro_batches(rows, shared_prompts) if rows is not None else []
        return chunks if self.shards is None else self.shards.lockstep(chunks, models, backward)

    per_layer_fsdp = property(lambda self: self.shards is not None and self.shards.mode == "per_layer")

    def prompt_groups(self, samples) -> torch.Tensor | None:
        """The ids that let a pass run each distinct prompt once for its rows (``logprobs.completion_logits``);
        None under per-layer FSDP: a pass would forward the model twice, or once for 1-token completions."""
        return None if self.per_layer_fsdp else samples.group_ids

    @property
    def learners(self) -> list[list[int]]:
        """The roles each distinct model plays: one optimizer per entry."""
        return roles_by_model(list(self.agents))

    def model_of(self, learner: int) -> nn.Module:
        return self.agents[self.learners[learner][0]].model

    def learner_of(self, role: int) -> int:
        return next(n for n, roles in enumerate(self.learners) if role in roles)

    def learner_name(self, index: int) -> str:
        return "shared" if len(roles := self.learners[index]) > 1 else f"agent{roles[0]}"

    def configure_optimizers(self):
        return [
            torch.optim.AdamW(
                [{"params": self.agents[roles[0]].trainable_parameters(), "role": "policy"}],
                lr=self.hparams.learning_rate,
                weight_decay=self.weight_decay,
            )
            for roles in self.learners
        ]

    def setup(self, stage: str) -> None:
        if stage == "fit":
            trainer = self.trainer
            for name in ("limit_train_batches", "max_epochs", "max_steps"):
                if getattr(trainer, name, None) == 0:
                    raise ConfigError(
                        f"trainer.{name}=0: no training step would run, and the run would end as if it had trained; "
                        "give a number > 0 (max_epochs/max_steps: -1 for no limit), or use `lit-marl validate`"
                    )
        if self.memory.weights_dtype != "float32" and self.trainer.precision != "bf16-mixed":
            raise ConfigError(
                f"model.memory.weights_dtype={self.memory.weights_dtype} computes in bf16 under autocast: set "
                f"trainer.precision: bf16-mixed (got {self.trainer.precision}; trained weights and AdamW's state stay "
                "fp32), or "
                "model.memory.weights_dtype: float32"
            )
        strategy = self.trainer.strategy
        if isinstance(strategy, DDPStrategy) and not isinstance(strategy, TeamDDPStrategy):
            raise ConfigError(
                f"trainer.strategy={type(strategy).__name__}: DistributedDataParallel cannot follow an agent team's "
                "updates (several backward passes per step, different on each rank); use trainer.strategy: "
                "{class_path: lit_marl.parallel.strategies.TeamDDPStrategy}"
            )
        cpu.configure(self.trainer)  # threads per rank; what a CPU run computes with, said once
        data = self.trainer.datamodule
        self.rollout_settings = rollout = data.rollout_settings if data is not None else None
        if self.sources is None:
            if rollout is None:
                raise ConfigError("model.num_agents: give it, or a data module to take it from")
            self.size_team(rollout.num_agents)
        if rollout is not None and rollout.num_agents != self.hparams.num_agents:
            raise ConfigError(
                f"the data gives {rollout.num_agents} agents (data.agent_prompts / its environment) but "
                f"model.num_agents={self.hparams.num_agents}"
            )

    def require_groups(self, stage: str, compares: str) -> None:
        """Group baselines need at least 2 samples per group: fail before the first rollout."""
        rollout = self.rollout_settings
        if stage == "fit" and rollout is not None and rollout.num_generations < 2:
            raise ConfigError(
                f"data.num_generations={rollout.num_generations}: {type(self).__name__} compares {compares} and "
                "needs at least 2; set data.num_generations >= 2"
            )

    # ------------------------------------------------------------------ the step: fine-tuning on demonstrations or RL
    phase: str = "rl"
    """``sft`` while the run fine-tunes on demonstrations (``callbacks.PhaseSwitch`` sets it; the ``SFT``
    module always), ``rl`` otherwise. The data module serves demonstrations or rollouts to match."""

    @property
    def runs_rl(self) -> bool:
        """Whether this algorithm takes RL steps (``rl_step``), e.g. after an SFT phase."""
        return type(self).rl_step is not AgentTeamModule.rl_step

    def training_step(self, batch, batch_idx: int) -> None:
        if self.phase == "sft":
            self.sft_step(batch)
        else:
            self.rl_step(self.scored(batch, training=True), batch_idx)
        self.write_step_log()

    def scored(self, batch, training: bool = False):
        """A tree rollout's returns from its facts (``RolloutBatch.score``): this algorithm's
        ``discount``, and in training its ``response_penalties``; episodes come as they are."""
        if isinstance(batch, RolloutBatch):
            batch.score(self.discount, self.response_penalties(batch) if training else None)
            if batch.comparator is not None:
                batch.comparator.score(self.discount)
        return batch

    def response_penalties(self, batch: RolloutBatch) -> list[torch.Tensor] | None:
        """Per agent one value per row, subtracted from the reward of every joint action the response
        is part of before returns (MAGRPO's KL to a reference); None: none."""
        return None

    def rl_step(self, batch, batch_idx: int) -> None:
        raise NotImplementedError

    def sft_step(self, per_agent: list[DemoSamples]) -> None:
        """One optimizer step per learner on its roles' demonstrations: the mean negative
        log-likelihood of the assistant tokens (over all ranks), the weights RL then continues from."""
        with Timer() as train_time, self.computing(update=True):
            losses, tokens = [], 0.0
            for index, roles in enumerate(self.learners):
                agent = self.agents[roles[0]]
                samples = DemoSamples.cat([per_agent[r] for r in roles], agent.pad_token_id)
                count = float(samples.loss_mask.sum())
                loss_fn = lambda mb, m=agent.model: sft_loss(m, mb)  # noqa: E731
                losses.append(self.update_agent(index, samples, loss_fn, count=count))
                tokens += count
                self.record({f"{self.learner_name(index)}/sft_loss": losses[-1]})
        self.record({"train/sft_loss": sum(losses) / len(losses), "perf/train_s": train_time.seconds})
        self.record({"train/sft_tokens": tokens}, reduce="sum")

    # ------------------------------------------------------------------ buffered updates (MAGRPO family, IAC/MAAC)
    def buffer_step(self, batch: RolloutBatch, per_agent: list[AgentSamples]) -> None:
        """Add a training step's samples to the agents' buffers and update (``flush_buffers``) once
        they hold ``model.buffer.size`` groups, decided over all ranks (their trees, hence their
        buffers, can differ)."""
        for buffer, samples in zip(self.rollout_buffers, per_agent):
            buffer.add(samples)
        size = self.buffer.size
        if size is None or all_ranks_max(len(self.rollout_buffers[0]) >= size, self.device):
            with self.computing(update=True):
                self.flush_buffers()
        self.log_rollout(batch, "train")

    def flush_buffers(self) -> None:  # one update on everything buffered (algorithms that buffer)
        raise NotImplementedError

    def on_train_epoch_end(self) -> None:
        """What is left in the rollout buffers is used at the end of every training epoch, so no
        sample is dropped when an epoch ends before a buffer fills (after the callbacks' epoch end,
        before the checkpoints': Lightning's order)."""
        if self.rollout_buffers:
            with self.computing(update=True):
                self.flush_buffers()
            if self.step_log:  # the flush's losses, at the epoch's last step
                self.write_step_log(step_end=False)

    # ------------------------------------------------------------------ several ranks
    @property
    def world_size(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """What Lightning does not save, for every rank (Lightning writes rank 0's checkpoint): the
        sampling RNG (rollouts continue with the same random numbers), the mini-batch order
        generator, and the samples waiting in the rollout buffers. Plain tensors only."""
        state = {**checkpoint_files.rank_state(self.shuffle_generator, self.rollout_buffers), **self.rank_state()}
        # every rank saves (joins this gather); rank 0 writes
        checkpoint["lit_marl"] = {"ranks": [to_cpu(r) for r in gather_objects(state)]}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        path = self._trainer.ckpt_path if self._trainer is not None else None
        if path:  # before any weight is applied: a damaged file is refused (the CLI checked it already)
            checkpoint_files.check_recorded(path)
        critic_lr = getattr(self, "critic_learning_rate", None)
        checkpoint_files.configured_settings_win(checkpoint, self.hparams.learning_rate, critic_lr, self.weight_decay)
        saved = checkpoint.get("lit_marl")
        if saved is None:
            return  # a checkpoint from outside lit_marl: weights and optimizers only
        state = checkpoint_files.restore_rank_state(
            saved, self.world_size, self.global_rank, self.shuffle_generator, self.rollout_buffers, type(self).__name__
        )
        self.load_rank_state(state)

    def rank_state(self) -> dict:
        """An algorithm's own per-rank resume state (plain tensors and lists), saved with the above."""
        return {}

    def load_rank_state(self, state: dict) -> None:
        pass

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self.log_rollout(self.scored(batch), "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self.log_rollout(self.scored(batch), "test")
