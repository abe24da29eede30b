"""``ShardedBatchSampler``: deal the batches of any batch sampler round-robin to the ranks.

:func:`~lightning_mpi.data.sharding.shard_indices` shards samples; this shards whole batches,
for a custom batch sampler that decides itself which indices form a batch (for example a
sampler that keeps the sequences of a batch contiguous, like Lightning's demo
``SequenceSampler``) and that Lightning's distributed sampler cannot rewrite. Every rank wraps
the same inner sampler, which must yield the same batches in the same order on every rank (the
same seed and epoch); rank ``r`` of ``W`` keeps batches ``r, r + W, r + 2W, ...``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

__all__ = ["ShardedBatchSampler"]


class BatchSampler(Protocol):
    """What :class:`ShardedBatchSampler` wraps: index batches with a length (``set_epoch`` optional)."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


class ShardedBatchSampler:
    """Rank ``rank``'s share of the batches of ``batch_sampler``.

    Every rank yields ``len(batch_sampler) // num_replicas`` batches, so ranks that step a
    synchronous exchange once per batch stay in step. The last ``len(batch_sampler) %
    num_replicas`` batches of each epoch are dropped; across all ranks every batch of the inner
    sampler is used at most once.

    Args:
        batch_sampler: an iterable of index batches with ``__len__`` (a torch ``BatchSampler``
            or any custom one); its ``set_epoch`` is called by :meth:`set_epoch` if it has one.
        num_replicas: number of ranks sharing the batches (``>= 1``).
        rank: this rank, in ``[0, num_replicas - 1]``.

    Raises:
        ValueError: at construction, for a ``batch_sampler`` that is not an iterable with
            ``__len__``, or a ``num_replicas`` or ``rank`` outside its range.
    """

    def __init__(self, batch_sampler: BatchSampler, num_replicas: int, rank: int) -> None:
        where = "ShardedBatchSampler"
        if not (hasattr(batch_sampler, "__iter__") and hasattr(batch_sampler, "__len__")):
            raise ValueError(
                f"{where}: batch_sampler must be an iterable of index batches with __len__, "
                f"got {type(batch_sampler).__name__}"
            )
        if not _is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"{where}: num_replicas must be an int >= 1, got {num_replicas!r}")
        if not _is_int(rank) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"{where}: rank must be an int in [0, num_replicas - 1] = [0, {int(num_replicas) - 1}], got {rank!r}"
            )
        self.batch_sampler = batch_sampler
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)

    def __len__(self) -> int:
        return len(self.batch_sampler) // self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        # Counted once per epoch: the inner sampler's length may change with its epoch.
        used = len(self) * self.num_replicas
        if used == 0:
            return
        for position, batch in enumerate(self.batch_sampler):
            if position % self.num_replicas == self.rank:
                yield batch
            if position + 1 >= used:
                # Stop before the remainder, without drawing it from the inner sampler.
                return

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the inner sampler, if it has ``set_epoch`` (e.g. to reshuffle)."""
        set_epoch = getattr(self.batch_sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __repr__(self) -> str:
        return (
            f"ShardedBatchSampler({type(self.batch_sampler).__name__}, rank={self.rank}/{self.num_replicas}, "
            f"batches={len(self)})"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
