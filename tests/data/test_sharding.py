"""Tests for lightning_mpi.data.sharding: the pure sharding rule, every rank simulated in-process."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_mpi.data import PrefetchLoader, epoch_order, num_batches_per_rank, shard_indices
from tests.data.helpers import IndexDataset

pytestmark = pytest.mark.timeout(60)

SIZES = [1, 2, 5, 7, 10, 13, 33]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_pad_exactly_once_among_valid_positions(world_size, batch_size, shuffle):
    for n in SIZES:
        plans = [
            shard_indices(n, world_size, r, batch_size, shuffle=shuffle, seed=3, epoch=1) for r in range(world_size)
        ]
        per_rank = math.ceil(n / world_size)
        expected_batches = math.ceil(per_rank / batch_size)
        batch_sizes = set()
        for p in plans:
            assert len(p.indices) == per_rank
            assert p.num_batches == expected_batches == num_batches_per_rank(n, world_size, batch_size)
            batch_sizes.add(tuple(p.batch_slice(k).stop - p.batch_slice(k).start for k in range(p.num_batches)))
            # padding can only be the rank's last position
            assert p.valid[:-1].all()
        assert len(batch_sizes) == 1, f"batch sizes differ across ranks: {batch_sizes}"
        assert all(s == batch_size for s in next(iter(batch_sizes))[:-1])
        valid = np.concatenate([p.indices[p.valid] for p in plans])
        assert sorted(valid.tolist()) == list(range(n)), "every sample exactly once among valid positions"
        padded = np.concatenate([p.indices[~p.valid] for p in plans])
        assert len(padded) == per_rank * world_size - n < world_size
        assert set(padded.tolist()) <= set(range(n))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_drop_last_at_most_once_full_equal_batches(world_size, batch_size):
    for n in SIZES:
        if n < world_size * batch_size:
            with pytest.raises(ValueError, match="drop_last=True leaves no batch"):
                PrefetchLoader(IndexDataset(n), batch_size=batch_size, world_size=world_size, drop_last=True)
            continue
        plans = [shard_indices(n, world_size, r, batch_size, epoch=2, drop_last=True) for r in range(world_size)]
        expected = n // (world_size * batch_size)
        for p in plans:
            assert p.valid.all()
            assert p.num_batches == expected == num_batches_per_rank(n, world_size, batch_size, drop_last=True)
            assert len(p.indices) == expected * batch_size  # every batch full
        seen = np.concatenate([p.indices for p in plans]).tolist()
        assert len(seen) == len(set(seen)) and set(seen) <= set(range(n))
        assert n - len(seen) < world_size * batch_size  # only the remainder is dropped


def test_order_depends_only_on_seed_and_epoch():
    n, w = 29, 3
    for epoch in range(3):
        order = epoch_order(n, shuffle=True, seed=7, epoch=epoch)
        plans = [shard_indices(n, w, r, 4, seed=7, epoch=epoch) for r in range(w)]
        # dealing round-robin reassembles the global order: the same permutation on every rank
        dealt = np.empty(sum(len(p.indices) for p in plans), dtype=np.int64)
        for r, p in enumerate(plans):
            dealt[r::w] = p.indices
        assert dealt[:n].tolist() == order.tolist()
        assert np.array_equal(order, epoch_order(n, shuffle=True, seed=7, epoch=epoch))
    orders = {tuple(epoch_order(n, shuffle=True, seed=s, epoch=e)) for s in (7, 8) for e in (0, 1, 2)}
    assert len(orders) == 6, "each (seed, epoch) gives its own permutation"
    assert epoch_order(n, shuffle=False, seed=7, epoch=5).tolist() == list(range(n))


def test_shard_indices_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size - 1\] = \[0, 1\], got 2"):
        shard_indices(10, 2, 2, 3)
