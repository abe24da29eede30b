"""Tests for lightning_mpi.data.loader and .pipeline: PrefetchLoader on its own, outside Lightning."""
from __future__ import annotations

import gc
import time
import traceback

import pytest
import torch

from lightning_mpi.data import PrefetchLoader
from lightning_mpi.data import transforms as T
from tests.data.helpers import FailingDataset, IndexDataset, digest, loader_threads

pytestmark = pytest.mark.timeout(60)


def test_prefetch_is_bounded_and_overlaps():
    ds = IndexDataset(40, delay_s=0.0)
    loader = PrefetchLoader(ds, batch_size=4, prefetch=2, num_threads=2, shuffle=False)
    it = iter(loader)
    assert ds.loaded == [] and loader_threads() == [], "iter() alone starts nothing"
    next(it)
    time.sleep(0.3)
    # the batch handed out + at most `prefetch` batches waiting
    assert len(ds.loaded) == (1 + 2) * 4
    next(it)
    time.sleep(0.3)
    assert len(ds.loaded) == (2 + 2) * 4
    it.close()
    assert loader_threads() == []

    # a load of ~20 ms per batch behind a ~20 ms step: serial would take ~2 x 20 ms per batch
    slow = IndexDataset(24, delay_s=0.01)
    loader = PrefetchLoader(slow, batch_size=2, prefetch=2, shuffle=False)
    t0 = time.perf_counter()
    for _ in loader:
        time.sleep(0.02)
    elapsed = time.perf_counter() - t0
    serial = 12 * (0.02 + 0.02)
    assert elapsed < 0.8 * serial, f"no overlap: {elapsed:.3f}s vs serial {serial:.3f}s"
    assert loader.stats.batches == 12
    assert loader.stats.wait_s[0] > 0.01  # the first batch cannot be hidden
    assert loader_threads() == []


def test_deterministic_batches_and_augmentation_across_threads():
    tf = T.Compose([T.RandomCrop(4), T.RandomMirror(0.5), T.MeanSubtract([1.0, 2.0, 3.0])])

    def epochs(seed, num_threads):
        loader = PrefetchLoader(IndexDataset(23), batch_size=5, seed=seed, num_threads=num_threads, transform=tf)
        out = []
        for e in range(2):
            loader.set_epoch(e)
            out.append(digest(list(loader)))
        return out

    a = epochs(seed=1, num_threads=1)
    assert a == epochs(seed=1, num_threads=3), "thread count must not change batches or augmentation"
    assert a[0] != a[1], "a new epoch reshuffles"
    assert epochs(seed=2, num_threads=1) != a


def test_abandoned_iterator_and_new_epoch_stop_threads():
    loader = PrefetchLoader(IndexDataset(50), batch_size=2, prefetch=3, num_threads=2)
    it = iter(loader)
    next(it)
    assert len(loader.live_threads) == 2
    it2 = iter(loader)  # a new epoch ends the old one
    assert loader_threads() == []
    with pytest.raises(StopIteration):
        next(it)
    next(it2)
    del it2  # dropped mid-epoch: collection stops the threads
    gc.collect()
    deadline = time.monotonic() + 5
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader_threads() == []


def test_return_mask_marks_exactly_the_padding():
    ds = IndexDataset(10)
    seen, padded = [], []
    for rank in range(4):
        loader = PrefetchLoader(ds, batch_size=2, rank=rank, world_size=4, return_mask=True, seed=5)
        batches = list(loader)
        assert len(batches) == len(loader) == 2
        for (x, y), valid in batches:
            assert valid.dtype == torch.bool and valid.shape == y.shape
            seen += y[valid].tolist()
            padded += y[~valid].tolist()
    assert sorted(seen) == list(range(10)) and len(padded) == 2


def test_loader_error_keeps_type_traceback_and_context():
    ds = FailingDataset(12)
    ds.bad = 7
    loader = PrefetchLoader(ds, batch_size=4, shuffle=False, num_threads=2)
    it = iter(loader)
    assert next(it)[1].tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError) as info:
        next(it)
    text = "".join(traceback.format_exception(info.value))
    assert 'raise KeyError(f"corrupt record {i}")' in text and "in __getitem__" in text
    assert "batch 1 of epoch 0 on rank 0 of 1 (dataset indices [4, 5, 6, 7])" in text
    assert loader_threads() == []
