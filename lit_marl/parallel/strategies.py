"""Several processes (ranks) on Lightning's DDP machinery, without DistributedDataParallel.

An update of an agent team runs several backward passes per training step (per agent, per
micro-batch, per mini-batch) and each rank's trees differ (early termination), so ranks run
different numbers of backward passes. DistributedDataParallel's reducer synchronizes inside every
backward and expects the same passes on every rank; it would hang or double-count. Here the module
stays unwrapped; ``AgentTeamModule`` sums each optimizer's gradients over ranks itself, once per
optimizer step, pads every rank's mini-batches to the same count and takes flush and early-stop
decisions over all ranks. Everything else (process launch, torchrun/SLURM environments, the
process group: gloo on CPU, NCCL on GPUs, ``num_nodes``) is Lightning's ``DDPStrategy``.

    trainer:
      strategy: {class_path: lit_marl.parallel.strategies.TeamDDPStrategy}
      devices: 2
"""

from __future__ import annotations

from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy


class TeamDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with the module left unwrapped (no DistributedDataParallel): every rank
    starts from rank 0's weights and ``AgentTeamModule`` sums the gradients over ranks itself."""

    def configure_ddp(self) -> None:
        _sync_module_states(self.model)  # every rank starts from rank 0's weights


class TeamFSDPStrategy(ModelParallelStrategy):
    """FSDP2 over all ranks: Lightning's ``ModelParallelStrategy`` with every rank in the
    data-parallel (sharding) dimension and no tensor parallelism. ``AgentTeamModule`` shards each
    model with ``fully_shard`` in ``configure_model``; how a team's uneven passes meet FSDP's
    collectives is in ``lit_marl.parallel.fsdp``.

        trainer:
          strategy: {class_path: lit_marl.parallel.strategies.TeamFSDPStrategy}
          devices: 2
    """

    def __init__(self, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
