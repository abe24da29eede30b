"""Datasets, models and thread/process probes shared by the lightning_mpi.data tests."""
from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import torch

from tests.quiet_trainer import QUIET


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
        QUIET,
        max_epochs=2,
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
