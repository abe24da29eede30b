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

To take the decision over, :meth:`LoaderSharding.take_over` turns the Trainer's
``use_distributed_sampler`` off for fit, validate and test and remembers the user's value, which
decides whether :meth:`LoaderSharding.shard` shards at all. ``predict`` is left to
Lightning (its predict loop wraps batch samplers itself to track indices).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, cast

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_mpi.data.batch_sampler import BatchSampler as SizedBatches
from lightning_mpi.data.batch_sampler import ShardedBatchSampler
from lightning_mpi.strategies.uneven_evaluation import warn_if_batches_dropped, warn_if_samples_repeat


def needs_batch_sharding(loader: DataLoader) -> bool:
    """True when ``loader`` has a batch sampler that Lightning cannot rebuild around a new sampler."""
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
    # needs_batch_sharding said the loader has one, sized (a DataLoader's batch sampler always is)
    batches = cast(SizedBatches, loader.batch_sampler)
    sharded = copy.copy(loader)
    object.__setattr__(sharded, "batch_sampler", ShardedBatchSampler(batches, num_replicas, rank))
    return sharded


class SkipFirst(Sampler):
    """``sampler`` whose first pass leaves out its first ``skip`` indices (a replacement joining
    mid-epoch skips the batches of its shard that the epoch went through); later passes are
    whole. Its length is the sampler's, as Lightning counts the batches already done."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        for i, index in enumerate(self.sampler):
            if i >= skip:
                yield index

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class LoaderSharding:
    """The Trainer strategy's sharding of every DataLoader (module docstring).

    Args:
        api: the Trainer package's names (``TrainerFn``, ``RunningStage``, Lightning's own
            sampler and loader rebuilders).
    """

    def __init__(self, api: Any) -> None:
        self._api = api
        self._shard_loaders: bool | None = None  # the user's use_distributed_sampler, kept for every stage
        #: the training loader's shard (num_replicas, rank) when it was last built; None: not sharded
        self.train_shard: tuple[int, int] | None = None
        #: (num_replicas, rank, batches to skip) for the next training loader only (a replacement's)
        self.next_training_shard: tuple[int, int, int] | None = None
        #: a heal during fit's validation: its loaders are to be built anew once it ended
        self._validation_reshard_pending = False
        #: the training loader was sharded and its first batch is not yet taken (Lightning is still
        #: setting it up: a reduce of its length comes next, and the epoch's first batch)
        self._training_loader_setting_up = False
        #: a heal while the training loader was set up: it is to be built anew from the next batch on
        self._training_reshard_pending = False

    def take_over(self, trainer: Any) -> None:
        """Before Lightning builds this stage's loaders: keep the user's ``use_distributed_sampler``
        and turn Lightning's own sharding off (predict excepted)."""
        connector = trainer._accelerator_connector
        if self._shard_loaders is None:
            self._shard_loaders = bool(connector.use_distributed_sampler)
        predicting = trainer.state.fn == self._api.TrainerFn.PREDICTING
        connector.use_distributed_sampler = self._shard_loaders if predicting else False

    def shard(self, dataloader: Any, trainer: Any, world_size: int, rank: int) -> Any:
        """This rank's share of ``dataloader`` (unchanged when it must not be sharded)."""
        training = trainer is not None and trainer.state.stage == self._api.RunningStage.TRAINING
        if training:
            self._training_loader_setting_up = True
        skip = 0
        if training and self.next_training_shard is not None:
            world_size, rank, skip = self.next_training_shard
            self.next_training_shard = None
        if not self._should_shard(dataloader, trainer, world_size):
            if training:
                self.train_shard = None
            return dataloader
        if training:
            self.train_shard = (world_size, rank)
        if needs_batch_sharding(dataloader):
            # validate/test leave batches out (each rank takes whole batches): say so, as ddp does
            warn_if_batches_dropped(dataloader.batch_sampler, world_size, trainer.state.fn, self._api.fabric.package)
            return with_sharded_batches(dataloader, world_size, rank)
        stage = trainer.state.stage
        # Lightning's own rule: training loaders are shuffled, evaluation loaders as the user made them.
        shuffle = True if training else self._api.is_dataloader_shuffled(dataloader)
        sampler = self._api.get_distributed_sampler(
            dataloader,
            shuffle,
            mode=stage,
            overfit_batches=trainer.overfit_batches,
            num_replicas=world_size,
            rank=rank,
        )
        # validate/test count padding samples twice: say so, as ddp does
        warn_if_samples_repeat(sampler, trainer.state.fn, self._api.fabric.package)
        if skip:
            sampler = SkipFirst(sampler, skip * (dataloader.batch_size or 1))
        return self._api.update_dataloader(dataloader, sampler, mode=stage)

    def reshard_next_epoch(self, trainer: Any) -> None:
        """After a heal: the loaders are built and sharded again over the new world size, the
        training loader from the next epoch and the validation loaders at the next validation
        (Lightning builds a stage's loaders again when it holds none). The current epoch goes on
        with the shards it has: the lost rank's share of it is not seen this epoch.

        A loader that Lightning is using or still setting up is dropped only at the next training
        batch (:meth:`at_training_batch`): fit's validation loaders during a validation (it is
        iterating them: the lost rank's share of that one validation is not evaluated), and the
        training loader between its sharding and the epoch's first batch (a heal in the reduce of
        its length: dropped there, Lightning's fit loop found no loader when it went on, an
        ``AssertionError``; measured once in an 8-rank partition run)."""
        fit_loop = getattr(trainer, "fit_loop", None)
        if fit_loop is None:
            return
        if self._training_loader_setting_up:
            self._training_reshard_pending = True
        else:
            fit_loop._combined_loader = None
        val_loop = getattr(getattr(fit_loop, "epoch_loop", None), "val_loop", None)
        if val_loop is None:
            return
        if getattr(trainer, "validating", False):
            self._validation_reshard_pending = True
        else:
            val_loop._combined_loader = None

    def at_training_batch(self, trainer: Any) -> None:
        """At a training batch: the training loader is set up; drop the loaders that a heal left to
        be built anew while they were in use or being set up (:meth:`reshard_next_epoch`)."""
        self._training_loader_setting_up = False
        fit_loop = getattr(trainer, "fit_loop", None)
        if self._training_reshard_pending:
            self._training_reshard_pending = False
            if fit_loop is not None:
                fit_loop._combined_loader = None
        if self._validation_reshard_pending:
            self._validation_reshard_pending = False
            val_loop = getattr(getattr(fit_loop, "epoch_loop", None), "val_loop", None)
            if val_loop is not None:
                val_loop._combined_loader = None

    def _should_shard(self, dataloader: Any, trainer: Any, world_size: int) -> bool:
        return (
            bool(self._shard_loaders)
            and trainer is not None
            and world_size > 1
            and trainer.state.fn != self._api.TrainerFn.PREDICTING
            and isinstance(dataloader, DataLoader)
            and not isinstance(dataloader.sampler, DistributedSampler)
            and not isinstance(dataloader.dataset, IterableDataset)
        )
