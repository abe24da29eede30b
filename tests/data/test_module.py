"""Tests for lightning_mpi.data.module (PrefetchDataModule): arguments, Trainer.fit, real MPI ranks."""
from __future__ import annotations

import hashlib
import json
import math
import threading
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_mpi.data import PrefetchDataModule, PrefetchLoader, num_batches_per_rank, shard_indices
from lightning_mpi.data import transforms as T
from tests.data.helpers import (
    FailingDataset,
    IndexDataset,
    child_pids,
    loader_threads,
    make_model,
    make_trainer,
)
from tests.mpi_utils import run_mpi_code

pytestmark = pytest.mark.timeout(60)


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


@pytest.mark.cuda  # pinned side-stream copies
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
from tests.quiet_trainer import QUIET
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
trainer = pl.Trainer(strategy="mpi_allreduce", accelerator="cpu", max_epochs=2, use_distributed_sampler=True,
                     **QUIET)
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
