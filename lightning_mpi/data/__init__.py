"""Shard a map-style Dataset over MPI ranks and load it in the background.

One job per module, from the bottom up:

* :mod:`~lightning_mpi.data.sharding` -- the pure sharding rule (:func:`shard_indices`): which
  dataset indices one rank loads in one epoch, which of them are padding, how they split into
  batches. No MPI, no threads.
* :mod:`~lightning_mpi.data.batch_sampler` -- :class:`ShardedBatchSampler`: deals the batches of
  any batch sampler round-robin to the ranks, the same number to each.
* :mod:`~lightning_mpi.data.transforms` -- image transforms seeded per sample, run by the loader.
* :mod:`~lightning_mpi.data.pipeline` -- one epoch of background loading: loader threads read,
  transform and collate up to ``prefetch`` batches ahead of the training step, and (on CUDA)
  copy them to the device from pinned memory on a side stream; an iterator hands them out in
  order.
* :mod:`~lightning_mpi.data.loader` -- :class:`PrefetchLoader`, an iterable over one rank's
  batches: one pipeline per epoch.
* :mod:`~lightning_mpi.data.hooks` -- :class:`PrefetchDataHooks`, the DataModule without
  Lightning: rank and world size from MPI, one loader per stage, the epoch from
  ``trainer.current_epoch``, wait-time logging, every loader thread stopped on teardown or on an
  exception.
``lightning_mpi.PrefetchDataModule`` (also ``lightning_mpi.data.PrefetchDataModule``) is those
hooks on ``pytorch_lightning``'s ``LightningDataModule``, built by
:mod:`lightning_mpi.strategies.build`: nothing in this package imports Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning_mpi.data.batch_sampler import ShardedBatchSampler
from lightning_mpi.data.hooks import PrefetchDataHooks
from lightning_mpi.data.loader import PrefetchLoader
from lightning_mpi.data.pipeline import LoaderStats
from lightning_mpi.data.sharding import ShardPlan, epoch_order, num_batches_per_rank, shard_indices

__all__ = [
    "LoaderStats",
    "PrefetchDataHooks",
    "PrefetchDataModule",
    "PrefetchLoader",
    "ShardPlan",
    "ShardedBatchSampler",
    "epoch_order",
    "num_batches_per_rank",
    "shard_indices",
]


def __getattr__(name: str) -> Any:
    # PrefetchDataModule is imported on first use, so that this package and its Lightning-free
    # modules import without Lightning.
    if name == "PrefetchDataModule":
        # The class on Lightning's DataModule is built by the strategy layer (the only place that
        # touches Lightning) and exported at the top: this is an alias of lightning_mpi.PrefetchDataModule.
        import lightning_mpi

        PrefetchDataModule = lightning_mpi.PrefetchDataModule

        globals()[name] = PrefetchDataModule
        return PrefetchDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
