"""Every rank on its own shard of every DataLoader, custom batch samplers included.

Lightning shards a DataLoader by rebuilding it around a ``DistributedSampler``. A custom batch
sampler that is not a torch ``BatchSampler`` (Lightning's own demo ``LightningLSTM`` has one)
cannot be rebuilt, and Lightning's ``ddp`` stops with "Lightning can't inject a (distributed)
sampler into your batch sampler". The Trainer strategies therefore shard loaders themselves:

- a loader Lightning can rebuild is rebuilt exactly as Lightning would (its own
  ``_get_distributed_sampler`` and ``_update_dataloader``), so nothing changes for it;
- a loader with a custom batch sampler keeps it, wrapped in a
  :class:`~lightning_mpi.data.batch_sampler.ShardedBatchSampler` that deals its batches to the
  ranks (rank r takes batches r, r + W, ...; every rank the same number).

To take the decision over, :meth:`LoaderSharding.setup` turns the Trainer's
``use_distributed_sampler`` off for fit, validate and test and remembers the user's value, which
decides whether :meth:`LoaderSharding.process_dataloader` shards at all. ``predict`` is left to
Lightning (its predict loop wraps batch samplers itself to track indices).
"""
from __future__ import annotations

import copy
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_mpi.strategies.uneven_evaluation import warn_if_batches_dropped, warn_if_samples_repeat  # issue 27: ddp's uneven-evaluation warning


def needs_batch_sharding(loader: DataLoader) -> bool:
    """True when ``loader`` has a batch sampler that Lightning cannot rebuild around a new sampler."""
    from lightning_mpi.data.batch_sampler import ShardedBatchSampler

    batch_sampler = loader.batch_sampler
    if batch_sampler is None or type(batch_sampler) is BatchSampler or isinstance(batch_sampler, ShardedBatchSampler):
        return False
    rebuildable = hasattr(batch_sampler, "__pl_saved_args") or (
        isinstance(batch_sampler, BatchSampler) and hasattr(batch_sampler, "sampler")
    )
    return not rebuildable


def with_sharded_batches(loader: DataLoader, num_replicas: int, rank: int) -> DataLoader:
    """A shallow copy of ``loader`` whose batches are this rank's share of its batch sampler's.

    The copy keeps the user's class and every other argument (workers, collate function, pinning).
    DataLoader refuses a new ``batch_sampler`` after construction, and rebuilding it from its
    arguments is what cannot be done for a custom batch sampler, so the attribute is set directly.
    """
    from lightning_mpi.data.batch_sampler import ShardedBatchSampler

    sharded = copy.copy(loader)
    object.__setattr__(sharded, "batch_sampler", ShardedBatchSampler(loader.batch_sampler, num_replicas, rank))
    return sharded


class LoaderSharding:
    """Trainer strategy mixin: shards loaders itself (see the module docstring)."""

    _api: Any
    world_size: int
    global_rank: int

    def setup(self, trainer: Any) -> None:
        connector = trainer._accelerator_connector
        if not hasattr(self, "_shard_loaders"):
            self._shard_loaders = bool(connector.use_distributed_sampler)  # the user's choice, kept for every stage
        predicting = trainer.state.fn == self._api.TrainerFn.PREDICTING
        connector.use_distributed_sampler = self._shard_loaders if predicting else False
        super().setup(trainer)  # type: ignore[misc]

    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if not self._should_shard(dataloader, trainer):
            return dataloader
        if needs_batch_sharding(dataloader):
            warn_if_batches_dropped(dataloader.batch_sampler, self.world_size, trainer.state.fn, self._api.fabric.package)  # issue 27: validate/test leave batches out
            return with_sharded_batches(dataloader, self.world_size, self.global_rank)
        stage = trainer.state.stage
        training = stage == self._api.RunningStage.TRAINING
        # Lightning's own rule: training loaders are shuffled, evaluation loaders as the user made them.
        shuffle = True if training else self._api.is_dataloader_shuffled(dataloader)
        sampler = self._api.get_distributed_sampler(
            dataloader, shuffle, mode=stage, overfit_batches=trainer.overfit_batches,
            **self.distributed_sampler_kwargs,  # type: ignore[attr-defined]
        )
        warn_if_samples_repeat(sampler, trainer.state.fn, self._api.fabric.package)  # issue 27: validate/test repeat padding samples, as ddp warns
        return self._api.update_dataloader(dataloader, sampler, mode=stage)

    def _should_shard(self, dataloader: Any, trainer: Any) -> bool:
        return (
            getattr(self, "_shard_loaders", False)
            and trainer is not None
            and self.world_size > 1
            and trainer.state.fn != self._api.TrainerFn.PREDICTING
            and isinstance(dataloader, DataLoader)
            and not isinstance(dataloader.sampler, DistributedSampler)
            and not isinstance(dataloader.dataset, IterableDataset)
        )
