"""The sharding rule: which dataset indices one rank loads in one epoch. No MPI, no threads.

Every rank computes its own share from ``(num_samples, world_size, rank, batch_size, seed,
epoch)`` alone, and all ranks get the same number of batches of the same sizes
(:func:`shard_indices`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_mpi.data.checks import check_bool, check_int

__all__ = ["ShardPlan", "epoch_order", "num_batches_per_rank", "shard_indices"]


@dataclass(frozen=True)
class ShardPlan:
    """What one rank loads in one epoch.

    Attributes:
        indices: dataset indices in load order (``int64``).
        valid: ``False`` where the position is padding, i.e. a repeat of a sample that another
            position of the epoch already holds (only with ``drop_last=False``).
        batch_size: the batch size; the last batch may be shorter, equally on every rank.
    """

    indices: np.ndarray
    valid: np.ndarray
    batch_size: int

    @property
    def num_batches(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def batch_slice(self, k: int) -> slice:
        """Positions of batch ``k`` in :attr:`indices`."""
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {k} out of range [0, {self.num_batches})")
        return slice(k * self.batch_size, min((k + 1) * self.batch_size, len(self.indices)))


def num_batches_per_rank(num_samples: int, world_size: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches per rank per epoch; the same on every rank and in every epoch.

    ``ceil(ceil(N / W) / B)`` with ``drop_last=False``, ``floor(N / (W * B))`` with ``drop_last=True``.
    """
    n = check_int("num_samples", num_samples, 0, "num_batches_per_rank")
    w = check_int("world_size", world_size, 1, "num_batches_per_rank")
    b = check_int("batch_size", batch_size, 1, "num_batches_per_rank")
    if drop_last:
        return n // (w * b)
    return math.ceil(math.ceil(n / w) / b)


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order: a permutation of ``range(num_samples)``.

    It depends only on ``(seed, epoch)``, so every rank computes the same one without
    communicating. ``shuffle=False`` gives ``0, 1, ..., N-1``.
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    # numpy's SeedSequence hashes the whole entropy list; the result is fixed across platforms
    # and numpy versions (PCG64 and its seeding are frozen by numpy's stream policy).
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def shard_indices(
    num_samples: int,
    world_size: int,
    rank: int,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> ShardPlan:
    """The indices rank ``rank`` of ``world_size`` loads in ``epoch``.

    The epoch's order (:func:`epoch_order`) is dealt round-robin: global position ``p`` goes to
    rank ``p % world_size``. The remainder is handled so that every rank gets the same number
    of batches, of the same sizes:

    * ``drop_last=False`` (pad): the order is extended cyclically to ``ceil(N / W) * W``
      positions, so fewer than ``W`` positions are padding. A padded position repeats a sample
      from the start of the epoch's order and is marked ``valid == False``. Every sample appears
      exactly once among the valid positions of all ranks together. Padding only ever sits in
      the last position of a rank, i.e. in its last batch. Each rank has ``ceil(N / W)``
      positions in ``ceil(ceil(N / W) / B)`` batches; only the last one may be shorter than ``B``.
    * ``drop_last=True`` (drop): only the first ``floor(N / (W * B)) * W * B`` positions are
      used; every batch is full and every sample appears at most once. With ``shuffle=True`` a
      different set of samples is dropped each epoch.
    """
    where = "shard_indices"
    n = check_int("num_samples", num_samples, 1, where)
    w = check_int("world_size", world_size, 1, where)
    b = check_int("batch_size", batch_size, 1, where)
    r = check_int("rank", rank, 0, where)
    if r >= w:
        raise ValueError(f"{where}: rank must be in [0, world_size - 1] = [0, {w - 1}], got {rank!r}")
    s = check_int("seed", seed, 0, where)
    e = check_int("epoch", epoch, 0, where)
    shuffle = check_bool("shuffle", shuffle, where)
    drop_last = check_bool("drop_last", drop_last, where)

    order = epoch_order(n, shuffle=shuffle, seed=s, epoch=e)
    if drop_last:
        total = (n // (w * b)) * w * b
        positions = np.arange(r, total, w, dtype=np.int64)
        return ShardPlan(indices=order[positions], valid=np.ones(len(positions), dtype=bool), batch_size=b)
    total = math.ceil(n / w) * w
    positions = np.arange(r, total, w, dtype=np.int64)
    # positions >= n wrap around to the start of the order: those are the padding
    return ShardPlan(indices=order[positions % n], valid=positions < n, batch_size=b)
