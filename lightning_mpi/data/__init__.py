"""Data loading for MPI training: shard a map-style Dataset over ranks and load it in the background."""
from lightning_mpi.data.loader import (
    LoaderStats,
    PrefetchDataModule,
    PrefetchLoader,
    ShardPlan,
    epoch_order,
    num_batches_per_rank,
    shard_indices,
)

__all__ = [
    "LoaderStats",
    "PrefetchDataModule",
    "PrefetchLoader",
    "ShardPlan",
    "epoch_order",
    "num_batches_per_rank",
    "shard_indices",
]
