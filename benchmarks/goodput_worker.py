"""The training job of benchmarks/goodput.py, run by every rank of every arm.

    lightning-mpi -n 3 [--heal] [--max-restarts R] goodput_worker.py OUT --frontend mpi [--heal shrink]
    python -m torch.distributed.run --standalone --nproc-per-node 3 [--max-restarts R] \\
        goodput_worker.py OUT --frontend ddp

A Lightning ``Trainer`` trains a small MLP on a fixed synthetic classification set (labels from
a random linear teacher) for ``--steps`` optimizer steps, ``--batch`` samples per rank and step,
with a ``ModelCheckpoint`` every ``--ckpt-every`` steps (every arm, so that every arm pays for its
checkpoints). ``--frontend mpi`` uses ``lightning_mpi.SyncStrategy`` (with ``heal=`` when given);
``--frontend ddp`` uses Lightning's ``DDPStrategy`` on gloo and resumes with ``ckpt_path="last"``,
as a Lightning user does under ``torchrun --max-restarts``. ``lightning-mpi --max-restarts``
resumes the ``mpi`` frontend by itself (``fit`` without ``ckpt_path``).

What the benchmark reads, under OUT:

- ``progress``: rank 0 appends ``time global_step world_size pid`` after every training batch;
- ``pids/<pid>``: every process writes its rank at its first training batch (and again when its
  rank changes, after a heal), so that the benchmark knows which processes it may SIGKILL (never
  rank 0, whose lines are the record).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 8192
FEATURES = 64
CLASSES = 10


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class Task(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, CLASSES)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Record(Callback):
    """Rank 0's progress lines; every process's pid file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rank: int | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rank = trainer.global_rank
        if rank != self.rank:  # first batch of this process, or a heal renumbered it
            self.rank = rank
            (self.out / "pids" / str(os.getpid())).write_text(str(rank))
        if rank == 0:
            with open(self.out / "progress", "a") as log:
                log.write(f"{time.time():.4f} {trainer.global_step} {trainer.world_size} {os.getpid()}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--frontend", choices=["mpi", "ddp"], required=True)
    parser.add_argument("--heal", choices=["shrink", "replace"], default=None)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ckpt-every", type=int, default=250)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # each relaunch would repeat Lightning's hints in the log
    torch.set_num_threads(1)  # 3 ranks on 2 cores: threads would only fight
    (args.out / "pids").mkdir(parents=True, exist_ok=True)

    fit_kwargs: dict = {}
    if args.frontend == "mpi":
        import lightning_mpi

        options = {"heal": args.heal} if args.heal else {}
        trainer_kwargs: dict = {"strategy": lightning_mpi.SyncStrategy(log_stats=False, **options)}
    else:
        from pytorch_lightning.strategies import DDPStrategy

        world = int(os.environ["WORLD_SIZE"])
        trainer_kwargs = {"strategy": DDPStrategy(process_group_backend="gloo"), "devices": world}
        fit_kwargs["ckpt_path"] = "last"  # what a Lightning user writes to resume under torchrun
    checkpoint = ModelCheckpoint(
        dirpath=args.out / "checkpoints", every_n_train_steps=args.ckpt_every, save_last=True, save_top_k=1
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        max_epochs=-1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, Record(args.out)],
        **trainer_kwargs,
    )
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True, drop_last=True)
    trainer.fit(Task(args.width), loader, **fit_kwargs)


if __name__ == "__main__":
    main()
