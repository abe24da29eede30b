"""Tests for lightning_mpi.data (PrefetchDataModule, sharding) and lightning_mpi.transforms."""
from __future__ import annotations

import gc
import hashlib
import json
import math
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mpi.data import transforms as T
from lightning_mpi.data import (
    PrefetchDataModule,
    PrefetchLoader,
    epoch_order,
    num_batches_per_rank,
    shard_indices,
)
from tests.mpi_utils import run_mpi_code

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------
# helpers


class IndexDataset:
    """Sample i is (a small image whose pixels encode i, i)."""

    def __init__(self, n: int, size: int = 6, delay_s: float = 0.0):
        self.n, self.size, self.delay_s = n, size, delay_s
        self.loaded: list[int] = []
        self._lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.loaded.append(i)
        img = torch.arange(3 * self.size * self.size, dtype=torch.float32).reshape(3, self.size, self.size) + 1000 * i
        return img, i


class FailingDataset(IndexDataset):
    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"corrupt record {i}")  # the line the traceback must show
        return super().__getitem__(i)


def child_pids() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning_mpi-prefetch")]


def digest(batches) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


def make_trainer(**kw):
    import pytorch_lightning as pl

    defaults = dict(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        strategy="auto",
    )
    defaults.update(kw)
    return pl.Trainer(**defaults)


def make_model(**behaviour):
    """A tiny regression model that records the sample ids it trains and validates on."""
    import pytorch_lightning as pl

    class Recorder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 4 * 4, 1)
            self.train_ids: dict[int, list[int]] = {}
            self.val_ids: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.train_ids.setdefault(self.current_epoch, []).extend(y.tolist())
            if behaviour.get("raise_at") == batch_idx:
                raise RuntimeError("boom in training_step")
            if behaviour.get("stop_at") == batch_idx:
                self.trainer.should_stop = True
            return self.layer(x.flatten(1)).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            if not self.trainer.sanity_checking:
                self.val_ids.extend(y.tolist())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Recorder()


# ------------------------------------------------------------------------------------------
# sharding rule (pure, every rank simulated in-process)

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


# ------------------------------------------------------------------------------------------
# argument validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), r"batch_size must be an int >= 1, got 0"),
        (dict(batch_size=2.5), r"batch_size must be an int >= 1, got 2.5"),
        (dict(prefetch=0), r"prefetch must be an int >= 1, got 0"),
        (dict(num_threads=0), r"num_threads must be an int >= 1, got 0"),
        (dict(seed=-1), r"seed must be an int >= 0, got -1"),
        (dict(shuffle="yes"), r"shuffle must be True or False, got 'yes'"),
        (dict(transform=5), r"transform must be callable or None"),
        (dict(eval_transform="crop"), r"eval_transform must be callable or None"),
        (dict(drop_last=True, batch_size=11), r"drop_last=True leaves no train batch: len\(train_dataset\) = 10"),
        (dict(comm=object()), r"comm must be an MPI communicator"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefetchDataModule(IndexDataset(10), **kwargs)


def test_datamodule_rejects_bad_datasets():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

        def __len__(self):
            return 3

    with pytest.raises(ValueError, match=r"train_dataset must hold at least 1 sample, got len\(train_dataset\) == 0"):
        PrefetchDataModule(IndexDataset(0))
    with pytest.raises(ValueError, match="val_dataset must be a map-style dataset"):
        PrefetchDataModule(IndexDataset(3), val_dataset=42)
    with pytest.raises(ValueError, match="IterableDataset cannot be sharded"):
        PrefetchDataModule(Stream())
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size - 1\] = \[0, 1\], got 2"):
        shard_indices(10, 2, 2, 3)


# ------------------------------------------------------------------------------------------
# the loader on its own


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


# ------------------------------------------------------------------------------------------
# transforms


def test_transforms_values():
    img = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6)
    out = T.MeanSubtract([1.0, 2.0])(img)
    assert torch.equal(out[0], img[0] - 1) and torch.equal(out[1], img[1] - 2)
    assert torch.equal(T.MeanSubtract(img)(img), torch.zeros_like(img))  # a full mean image
    assert T.MeanSubtract(0.5)(img.to(torch.uint8)).dtype == torch.float32

    crop = T.RandomCrop((3, 4), seed=0)
    offsets = set()
    for _ in range(50):
        c = crop(img)
        assert c.shape == (2, 3, 4)
        top, left = divmod(int(c[0, 0, 0]), 6)
        assert torch.equal(c, img[:, top : top + 3, left : left + 4])
        offsets.add((top, left))
    assert len(offsets) > 3 and all(t <= 2 and l <= 2 for t, l in offsets)
    assert torch.equal(T.CenterCrop(3)(img), img[:, 1:4, 1:4])

    assert torch.equal(T.RandomMirror(1.0)(img), img.flip(-1))
    assert torch.equal(T.RandomMirror(0.0)(img), img)
    flips = sum(torch.equal(T.RandomMirror(0.5, seed=s)(img), img.flip(-1)) for s in range(200))
    assert 60 < flips < 140


def test_transforms_use_the_installed_sample_seed():
    img = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(3, 8, 8)
    tf = T.Compose([T.RandomCrop(5), T.RandomMirror()])
    with T.sample_seed(T.derive_seed(0, 1, 2)):
        a = tf(img)
    with T.sample_seed(T.derive_seed(0, 1, 2)):
        b = tf(img)
    assert torch.equal(a, b)
    outs = set()
    for idx in range(30):
        with T.sample_seed(T.derive_seed(0, 1, idx)):
            outs.add(tf(img).numpy().tobytes())
    assert len(outs) > 5
    assert T.current_generator() is None
    assert T.derive_seed(1, 2) != T.derive_seed(2, 1)


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: T.RandomCrop(0), r"RandomCrop: size must be >= 1 in both dims, got 0"),
        (lambda: T.RandomCrop((2, 2, 2)), r"RandomCrop: size must be an int >= 1 or a pair"),
        (lambda: T.CenterCrop(-3), r"CenterCrop: size must be >= 1"),
        (lambda: T.RandomMirror(1.5), r"RandomMirror: p must be a float in \[0, 1\], got 1.5"),
        (lambda: T.RandomMirror(seed=-2), r"RandomMirror: seed must be an int >= 0, got -2"),
        (lambda: T.MeanSubtract([]), r"MeanSubtract: mean must have at least one element"),
        (lambda: T.MeanSubtract(1.0, dtype=torch.int32), r"MeanSubtract: dtype must be a floating"),
        (lambda: T.Compose([T.CenterCrop(2), 3]), r"Compose: transforms\[1\] must be callable"),
        (lambda: T.RandomCrop(9)(torch.zeros(3, 8, 8)), r"RandomCrop: crop 9x9 is larger than the image 8x8"),
        (lambda: T.MeanSubtract([1.0, 2.0])(torch.zeros(3, 4, 4)), r"does not broadcast"),
    ],
)
def test_transforms_reject_bad_arguments(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# ------------------------------------------------------------------------------------------
# inside Trainer.fit at world size 1 (plain python)


def test_fit_covers_every_sample_per_epoch_and_logs_wait(tmp_path):
    from pytorch_lightning.loggers import CSVLogger

    threads0, children0 = set(threading.enumerate()), child_pids()
    dm = PrefetchDataModule(IndexDataset(23, size=4), IndexDataset(9, size=4), batch_size=4, seed=11)
    model = make_model()
    trainer = make_trainer(max_epochs=3, logger=CSVLogger(tmp_path), log_every_n_steps=2)
    trainer.fit(model, datamodule=dm)
    for epoch in range(3):
        # the epoch comes from trainer.current_epoch: the order is shard_indices' for that epoch
        assert model.train_ids[epoch] == shard_indices(23, 1, 0, 4, seed=11, epoch=epoch).indices.tolist()
    assert model.train_ids[0] != model.train_ids[1]
    assert model.val_ids == list(range(9)) * 3
    assert dm.wait_stats["train"].batches == 6 and dm.wait_stats["train"].epoch == 2
    metrics = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()
    for key in ("prefetch/train_wait_ms", "prefetch/train_epoch_wait_ms", "prefetch/val_epoch_wait_s"):
        assert key in metrics
    assert set(threading.enumerate()) == threads0
    assert child_pids() == children0


@pytest.mark.parametrize(
    "scenario",
    ["early_stop", "limit_batches", "exception_in_step", "loader_error"],
)
def test_fit_leaves_no_thread_or_process_behind(scenario):
    threads0, children0 = set(threading.enumerate()), child_pids()
    train = IndexDataset(40, size=4) if scenario != "loader_error" else FailingDataset(40, size=4)
    train.bad = 13
    dm = PrefetchDataModule(train, IndexDataset(12, size=4), batch_size=2, prefetch=3, num_threads=2, shuffle=False)
    model = make_model(stop_at=3 if scenario == "early_stop" else None, raise_at=2 if scenario == "exception_in_step" else None)
    trainer = make_trainer(limit_train_batches=3 if scenario == "limit_batches" else 1.0, limit_val_batches=2)
    if scenario == "exception_in_step":
        with pytest.raises(RuntimeError, match="boom in training_step"):
            trainer.fit(model, datamodule=dm)
    elif scenario == "loader_error":
        with pytest.raises(KeyError, match="corrupt record 13") as info:
            trainer.fit(model, datamodule=dm)
        text = "".join(traceback.format_exception(info.value))
        assert 'raise KeyError(f"corrupt record {i}")' in text, "original traceback reaches the training loop"
        assert "while loading train batch 6 of epoch 0" in text
        assert model.train_ids[0] == list(range(12)), "batches before the bad one were trained on"
    else:
        trainer.fit(model, datamodule=dm)
        expected = {"early_stop": [4 * 2], "limit_batches": [3 * 2, 3 * 2]}[scenario]
        assert [len(v) for v in model.train_ids.values()] == expected
    assert set(threading.enumerate()) == threads0
    assert child_pids() == children0


def test_fit_without_val_dataset_skips_validation():
    model = make_model()
    trainer = make_trainer(max_epochs=1)
    trainer.fit(model, datamodule=PrefetchDataModule(IndexDataset(9, size=4), batch_size=4, shuffle=False))
    assert model.train_ids[0] == list(range(9)) and model.val_ids == []
    assert loader_threads() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned side-stream copies)")
def test_cuda_batches_are_copied_on_a_side_stream():
    cpu = list(PrefetchLoader(IndexDataset(10), batch_size=4, shuffle=False))
    gpu = list(PrefetchLoader(IndexDataset(10), batch_size=4, shuffle=False, device="cuda", num_threads=2))
    assert len(gpu) == len(cpu) == 3
    for (xg, yg), (xc, yc) in zip(gpu, cpu):
        assert xg.is_cuda and yg.is_cuda
        assert torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
    # inside fit the DataModule targets the trainer's CUDA device
    dm = PrefetchDataModule(IndexDataset(10, size=4), batch_size=4, shuffle=False)
    model = make_model()
    make_trainer(max_epochs=1, accelerator="gpu", devices=1).fit(model, datamodule=dm)
    assert dm.loaders["train"].device.type == "cuda"
    assert model.train_ids[0] == list(range(10))
    assert loader_threads() == []


def test_setup_rejects_a_trainer_with_another_world_size():
    class FakeComm:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

    dm = PrefetchDataModule(IndexDataset(10), batch_size=2, comm=FakeComm())
    with pytest.raises(RuntimeError, match="communicator of size 2, but the trainer runs 1 processes"):
        make_trainer(max_epochs=1).fit(make_model(), datamodule=dm)
    assert loader_threads() == []


# ------------------------------------------------------------------------------------------
# real MPI ranks

SHARD_SCRIPT = r"""
import hashlib, json, threading, time
from mpi4py import MPI
import torch
from lightning_mpi.data import PrefetchDataModule
from lightning_mpi.data import transforms as T

class DS:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i):
        return torch.arange(3 * 6 * 6, dtype=torch.float32).reshape(3, 6, 6) + 1000 * i, i

def sleepy_barrier(comm):
    # MPICH busy-polls inside blocking collectives: a rank that got here first would spin a
    # core that the 4 oversubscribed ranks need for importing and loading. Poll gently instead.
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)

world = MPI.COMM_WORLD
report = {}
for W in (1, 2, 3, 4):
    sleepy_barrier(world)
    sub = world.Split(0 if world.rank < W else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        continue
    for n, b, drop in ((13, 3, False), (10, 4, False), (29, 2, True), (4, 1, False)):
        if drop and n < W * b:
            continue
        tf = T.Compose([T.RandomCrop(4), T.RandomMirror()])
        dm = PrefetchDataModule(DS(n), batch_size=b, drop_last=drop, seed=4, return_mask=True,
                                transform=tf, num_threads=2, comm=sub)
        loader = dm.train_dataloader()
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids, valid, h = [], [], hashlib.sha256()
            for (x, y), v in loader:
                ids += y.tolist(); valid += v.tolist(); h.update(x.numpy().tobytes())
            sleepy_barrier(sub)
            got = sub.gather((len(loader), ids, valid, h.hexdigest()), root=0)
            if sub.rank == 0:
                report[f"W{W}-n{n}-b{b}-drop{drop}-e{epoch}"] = got
        dm.close()
    sub.Free()
left = [t.name for t in threading.enumerate() if t.name.startswith("lightning_mpi")]
sleepy_barrier(world)
all_left = world.gather(left, root=0)
if world.rank == 0:
    print("REPORT " + json.dumps({"cases": report, "left": all_left}))
"""


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_sharding_under_mpi_world_sizes_1_to_4(tmp_path):
    # One 4-rank launch covers W = 1..4 through sub-communicators (one Lightning import per
    # rank instead of ten); the module shards over whatever communicator it is given.
    out = run_mpi_code(4, SHARD_SCRIPT, tmp_path, timeout=110).stdout
    report = json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:])
    assert report["left"] == [[], [], [], []], "loader threads left behind"
    cases = report["cases"]
    assert len(cases) == 4 * 4 * 2  # W = 1..4, four (n, batch_size, drop_last) cases, two epochs
    for key, ranks in cases.items():
        W = int(key.split("-")[0][1:])
        n, b = int(key.split("-n")[1].split("-")[0]), int(key.split("-b")[1].split("-")[0])
        drop = "dropTrue" in key
        assert len(ranks) == W
        counts = {r[0] for r in ranks}
        assert len(counts) == 1, f"{key}: batch counts differ across ranks: {counts}"
        assert counts == {num_batches_per_rank(n, W, b, drop)}
        assert len({len(r[1]) for r in ranks}) == 1, f"{key}: sample counts differ"
        real = [i for r in ranks for i, v in zip(r[1], r[2]) if v]
        if drop:
            assert all(all(r[2]) for r in ranks) and len(real) == len(set(real)) and n - len(real) < W * b
        else:
            assert sorted(real) == list(range(n)), f"{key}: not exactly once: {Counter(real)}"
            assert sum(len(r[2]) - sum(r[2]) for r in ranks) == math.ceil(n / W) * W - n
    # determinism across processes and runs: the W=1 run reproduces this process's batches
    tf = T.Compose([T.RandomCrop(4), T.RandomMirror()])

    class DS(IndexDataset):
        def __getitem__(self, i):
            return torch.arange(3 * 6 * 6, dtype=torch.float32).reshape(3, 6, 6) + 1000 * i, i

    loader = PrefetchLoader(DS(13), batch_size=3, seed=4, transform=tf)
    for epoch in range(2):
        loader.set_epoch(epoch)
        h = hashlib.sha256()
        for x, _ in loader:
            h.update(x.numpy().tobytes())
        assert cases[f"W1-n13-b3-dropFalse-e{epoch}"][0][3] == h.hexdigest()


FIT_SCRIPT = r"""
import json, threading, time
import torch
import pytorch_lightning as pl
import lightning_mpi
from lightning_mpi.data import PrefetchDataModule
from mpi4py import MPI

def sleepy_barrier(comm):
    # MPICH busy-polls in blocking collectives; wait for the slower rank's imports gently.
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)

sleepy_barrier(MPI.COMM_WORLD)

class DS:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i): return torch.full((8,), float(i)), i

class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = torch.nn.Linear(8, 1); self.ids = {}; self.val = []
    def training_step(self, batch, k):
        x, y = batch
        self.ids.setdefault(self.current_epoch, []).extend(y.tolist())
        return self.layer(x).pow(2).mean()
    def validation_step(self, batch, k):
        if not self.trainer.sanity_checking:
            self.val.extend(batch[1].tolist())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

before = {t.name for t in threading.enumerate()}
m = M()
dm = PrefetchDataModule(DS(23), DS(7), batch_size=4, seed=2)
trainer = pl.Trainer(strategy="mpi_allreduce", accelerator="cpu", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=True)
trainer.fit(m, datamodule=dm)
loaders_left = [t.name for t in threading.enumerate() if t.name.startswith("lightning_mpi-prefetch")]
sleepy_barrier(MPI.COMM_WORLD)
mine = {"rank": trainer.global_rank, "ids": m.ids, "val": m.val, "left": loaders_left}
ranks = MPI.COMM_WORLD.gather(mine, root=0)  # one print: mpiexec may interleave two ranks' lines
if MPI.COMM_WORLD.rank == 0:
    print("RANKS " + json.dumps(ranks))
"""


@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_fit_two_ranks_with_mpi_allreduce(tmp_path):
    import lightning_mpi  # noqa: F401 - importing registers the strategies
    from pytorch_lightning.strategies import StrategyRegistry

    if "mpi_allreduce" not in StrategyRegistry:
        pytest.skip("strategy 'mpi_allreduce' is not registered by `import lightning_mpi` yet")
    out = run_mpi_code(2, FIT_SCRIPT, tmp_path, timeout=140).stdout
    ranks = json.loads(next(line for line in out.splitlines() if line.startswith("RANKS "))[6:])
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for epoch in ("0", "1"):
        # 23 samples on 2 ranks: 12 each (one padded repeat), 3 batches each
        assert [len(r["ids"][epoch]) for r in ranks] == [12, 12]
        ids = ranks[0]["ids"][epoch] + ranks[1]["ids"][epoch]
        counts = Counter(ids)
        assert set(counts) == set(range(23)) and sum(c - 1 for c in counts.values()) == 1
    assert ranks[0]["ids"]["0"] != ranks[0]["ids"]["1"]
    assert sorted(ranks[0]["val"] + ranks[1]["val"]) == sorted(list(range(7)) * 2 + [0, 0])  # 1 pad per epoch
    assert all(r["left"] == [] for r in ranks)
