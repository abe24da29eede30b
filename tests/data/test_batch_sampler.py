"""Tests for lightning_mpi.data.batch_sampler: ShardedBatchSampler, every rank simulated in-process."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

from lightning_mpi.data import ShardedBatchSampler

pytestmark = pytest.mark.timeout(60)


class ListBatches:
    """A custom batch sampler (not a torch BatchSampler): batch k is ``[2k, 2k + 1]``; counts its epochs."""

    def __init__(self, num_batches: int) -> None:
        self.num_batches = num_batches
        self.epochs: list[int] = []

    def __iter__(self):
        return iter([[2 * k, 2 * k + 1] for k in range(self.num_batches)])

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def shards(batch_sampler, world_size: int) -> list[list]:
    return [list(ShardedBatchSampler(batch_sampler, world_size, rank)) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_batches", [0, 1, 2, 3, 4, 5, 7, 9, 10])
def test_ranks_take_batches_round_robin_in_equal_counts(world_size, num_batches):
    inner = ListBatches(num_batches)
    all_batches = list(inner)
    per_rank = shards(inner, world_size)
    expected = num_batches // world_size
    for rank, got in enumerate(per_rank):
        assert len(got) == len(ShardedBatchSampler(inner, world_size, rank)) == expected, "equal counts on every rank"
        assert got == all_batches[rank : expected * world_size : world_size], "batches r, r + W, r + 2W, ..."
    used = [tuple(b) for got in per_rank for b in got]
    assert len(used) == len(set(used)), "a batch is used at most once across ranks"
    assert len(used) == expected * world_size and num_batches - len(used) < world_size, "only the remainder is dropped"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_wraps_lightnings_sequence_sampler(world_size):
    from pytorch_lightning.demos.lstm import SequenceSampler

    # 50 samples in batches of 3 (contiguous sequences, not a torch BatchSampler): 16 batches
    inner = SequenceSampler(list(range(50)), batch_size=3)
    assert len(inner) == 16
    per_rank = shards(inner, world_size)
    assert {len(got) for got in per_rank} == {16 // world_size}
    assert sorted(tuple(b) for got in per_rank for b in got) == sorted(
        tuple(b) for k, b in enumerate(inner) if k < 16 // world_size * world_size
    )


def test_wraps_a_torch_batch_sampler_with_a_short_last_batch():
    inner = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)  # 3, 3, 3, 1
    assert shards(inner, 2) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    assert shards(inner, 3) == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]


def test_remainder_is_not_drawn_from_the_inner_sampler():
    drawn = []

    class Recording(ListBatches):
        def __iter__(self):
            for batch in super().__iter__():
                drawn.append(batch)
                yield batch

    list(ShardedBatchSampler(Recording(8), 3, 0))
    assert len(drawn) == 6


def test_set_epoch_is_passed_through_when_the_inner_sampler_has_it():
    inner = ListBatches(4)
    sampler = ShardedBatchSampler(inner, 2, 1)
    sampler.set_epoch(3)
    assert inner.epochs == [3]
    no_epoch = BatchSampler(SequentialSampler(range(4)), batch_size=2, drop_last=False)
    ShardedBatchSampler(no_epoch, 2, 0).set_epoch(5)  # nothing to pass it to: no error


def test_accepts_numpy_integers():
    sampler = ShardedBatchSampler(ListBatches(5), np.int64(2), np.int32(1))
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, 2)
    assert isinstance(sampler.rank, int)


@pytest.mark.parametrize(
    "args, match",
    [
        ((42, 2, 0), r"batch_sampler must be an iterable of index batches with __len__, got int"),
        ((iter([[0], [1]]), 2, 0), r"batch_sampler must be an iterable of index batches with __len__, got list_iterator"),
        ((ListBatches(4), 0, 0), r"num_replicas must be an int >= 1, got 0"),
        ((ListBatches(4), 2.0, 0), r"num_replicas must be an int >= 1, got 2.0"),
        ((ListBatches(4), True, 0), r"num_replicas must be an int >= 1, got True"),
        ((ListBatches(4), 3, 3), r"rank must be an int in \[0, num_replicas - 1\] = \[0, 2\], got 3"),
        ((ListBatches(4), 3, -1), r"rank must be an int in \[0, num_replicas - 1\] = \[0, 2\], got -1"),
        ((ListBatches(4), 3, torch.tensor(1)), r"rank must be an int in \[0, num_replicas - 1\] = \[0, 2\], got tensor"),
    ],
)
def test_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=r"^ShardedBatchSampler: " + match):
        ShardedBatchSampler(*args)
