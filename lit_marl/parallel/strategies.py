"""Several processes (ranks) on Lightning's DDP machinery, without DistributedDataParallel.

An update of an agent team runs several backward passes per training step (per agent, per
micro-batch, per mini-batch) and each rank's trees differ (early termination), so ranks run
different numbers of backward passes. DistributedDataParallel's reducer synchronizes inside every
backward and expects the same passes on every rank; it would hang or double-count. Here the module
stays unwrapped; ``AgentTeamModule`` sums each optimizer's gradients over ranks itself, once per
optimizer step, pads every rank's mini-batches to the same count and takes flush and early-stop
decisions over all ranks. Everything else (process launch, torchrun/SLURM environments, the
process group: gloo on CPU, NCCL on GPUs, ``num_nodes``) is Lightning's ``DDPStrategy``. Both
strategies stop every rank when one raises (``StopsTogether``, ``parallel/failure.py``).

    trainer:
      strategy: {class_path: lit_marl.parallel.strategies.TeamDDPStrategy}
      devices: 2
"""

from __future__ import annotations

import sys

from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lit_marl import ConfigError
from lit_marl.parallel import failure
from lit_marl.parallel.fsdp import MODES


class StopsTogether:
    """A strategy whose ranks stop together: once its process group exists every rank watches the
    others (``failure.watch``), and a rank whose trainer call raises reports it (``failure.report``):
    its error printed once, the other ranks ended within seconds instead of waiting in a collective."""

    def setup_environment(self) -> None:
        super().setup_environment()
        failure.watch(self)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        try:
            failure.report(exception)
        except Exception as err:  # never in place of the run's own error
            print(f"lit-marl: could not tell the other ranks that this one failed: {err!r}", file=sys.stderr)


class TeamDDPStrategy(StopsTogether, DDPStrategy):
    """Lightning's ``DDPStrategy`` with the module left unwrapped (no DistributedDataParallel): every rank
    starts from rank 0's weights and ``AgentTeamModule`` sums the gradients over ranks itself."""

    def configure_ddp(self) -> None:
        _sync_module_states(self.model)  # every rank starts from rank 0's weights


class TeamFSDPStrategy(StopsTogether, ModelParallelStrategy):
    """FSDP2 over all ranks: Lightning's ``ModelParallelStrategy`` with every rank in the
    data-parallel (sharding) dimension and no tensor parallelism. ``AgentTeamModule`` shards each
    model with ``fully_shard`` in ``configure_model``; how a team's uneven passes meet FSDP's
    collectives is in ``lit_marl.parallel.fsdp``.

        trainer:
          strategy:
            class_path: lit_marl.parallel.strategies.TeamFSDPStrategy
            init_args: {mode: per_layer}
          devices: 2

    Args:
        mode: ``gathered`` (each model gathered whole once per rollout and update: least traffic,
            for models that fit a device whole), ``per_layer`` (each decoder layer gathered only
            while it computes, gradients reduce-scattered in every backward: FSDP's memory, for 7B
            and up), or ``auto``: the memory plan picks ``gathered`` when its peak fits the device
            (docs/scale.md).
        gather_dtype: ``bfloat16`` gathers decoder layers in bf16 (half the traffic and the gathered
            bytes; gradients reduced in fp32; embeddings and heads stay fp32); ``per_layer`` only.
    """

    def __init__(self, mode: str = "auto", gather_dtype: str = "float32", **kwargs):
        if mode not in MODES:
            raise ConfigError(f"trainer.strategy.init_args.mode={mode!r}: choose one of {', '.join(MODES)}")
        if gather_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"trainer.strategy.init_args.gather_dtype={gather_dtype!r}: choose float32 or bfloat16")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.mode, self.gather_dtype = mode, gather_dtype

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
