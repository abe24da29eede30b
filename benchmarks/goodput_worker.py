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
  rank 0, whose lines are the record);
- ``weights/<pid>``: ``rank step digest`` of its final weights, written by every process whose
  ``fit`` returns. The benchmark ends the job by writing ``OUT/stop`` (the step to stop at,
  ``goodput_model.StopRequest``); every rank sets ``should_stop`` at that step.

Across simulated hosts (``benchmarks/cluster.py``) ``torchrun`` runs one agent per host: the
``ddp`` frontend then takes ``num_nodes`` from ``WORLD_SIZE / LOCAL_WORLD_SIZE``.
The model, data and optimizer are ``goodput_model``'s (shared with torchft's arm).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_model import WIDTH, StopRequest, dataset, mlp, optimizer, write_digest  # noqa: E402


class Task(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = mlp(width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return optimizer(self.parameters())


class Record(Callback):
    """Rank 0's progress lines; every process's pid file; the stop at the step the benchmark asks."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rank: int | None = None
        self.stop = StopRequest(out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rank = trainer.global_rank
        if rank != self.rank:  # first batch of this process, or a heal renumbered it
            self.rank = rank
            (self.out / "pids" / str(os.getpid())).write_text(str(rank))
        if rank == 0:
            with open(self.out / "progress", "a") as log:
                log.write(f"{time.time():.4f} {trainer.global_step} {trainer.world_size} {os.getpid()}\n")
        if self.stop.due(trainer.global_step):
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--frontend", choices=["mpi", "ddp"], required=True)
    parser.add_argument("--heal", choices=["shrink", "replace"], default=None)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=WIDTH)
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

        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        trainer_kwargs = {
            "strategy": DDPStrategy(process_group_backend="gloo"),
            "devices": local,
            "num_nodes": world // local,
        }
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
    task = Task(args.width)
    trainer.fit(task, loader, **fit_kwargs)
    write_digest(args.out, trainer.global_rank, trainer.global_step, task.net)


if __name__ == "__main__":
    main()
