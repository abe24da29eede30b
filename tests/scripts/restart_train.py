"""A small training run for the restart and preemption tests (launched by ``lightning-mpi``).

Every rank trains the tiny task with SGD under ``--strategy`` and appends each optimizer step it
trains to ``<out>/steps.<launch>.<rank>`` (``launch`` is ``LIGHTNING_MPI_RESTART``, 0 on a first
launch, or ``--launch``), so that a test can count the work that was done twice. At the end rank 0
saves the weights to ``<out>/final.pt`` with the world size and the last global step.

Faults, on the first launch only (``LIGHTNING_MPI_RESTART`` unset and ``--launch`` 0 or not given):

- ``--kill-rank R --kill-at S``: rank R SIGKILLs itself in the training step of global step S;
  with ``--drop-host H --hostfile F`` it first removes host H from hostfile F (its node is gone).
- ``--signal NAME --signal-rank R --signal-at S``: rank R sends itself signal NAME at step S
  (only that rank sees it); with ``--signal-on-restart``, on the launcher's first restart
  (``LIGHTNING_MPI_RESTART=1``) instead.
- ``--pause-at S``: rank 0 writes ``<out>/paused`` at step S and waits until ``<out>/go`` exists
  (the test signals the launcher meanwhile).
"""
import argparse
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

import lightning_mpi

sys.path.insert(0, str(Path(__file__).parent))
from tiny_task import dataset, make_net  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="sync", choices=["sync", "zero", "compressed", "downpour"])
parser.add_argument("--save-last", action="store_true", help="ModelCheckpoint(save_last=True)")
parser.add_argument("--samples", type=int, default=24)
parser.add_argument("--batches-per-epoch", type=int, default=1)
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--every-n-epochs", type=int, default=4)
parser.add_argument("--launch", type=int, default=None)
parser.add_argument("--kill-rank", type=int, default=None)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--drop-host", default=None)
parser.add_argument("--hostfile", default=None)
parser.add_argument("--signal", default=None)
parser.add_argument("--signal-rank", type=int, default=0)
parser.add_argument("--signal-at", type=int, default=None)
parser.add_argument("--signal-on-restart", action="store_true")
parser.add_argument("--pause-at", type=int, default=None)
args = parser.parse_args()
# The tests read lightning_mpi's warnings (resuming at another world size) from stderr.
warnings.filterwarnings("always", message="lightning_mpi")

out = Path(args.out)
launch = args.launch if args.launch is not None else int(os.environ.get("LIGHTNING_MPI_RESTART", "0"))
first_launch = os.environ.get("LIGHTNING_MPI_RESTART") is None and launch == 0
signal_launch = os.environ.get("LIGHTNING_MPI_RESTART") == "1" if args.signal_on_restart else first_launch

if args.strategy == "sync":
    strategy = lightning_mpi.SyncStrategy(log_stats=False, collective_timeout=120)
elif args.strategy == "zero":  # mpi_zero: the optimizer sharded, checkpoints saved as sharded directories
    strategy = lightning_mpi.SyncStrategy(exchange="asa", shard_optimizer=True, log_stats=False, collective_timeout=120)
elif args.strategy == "compressed":
    strategy = lightning_mpi.CompressedSyncStrategy(wire="topk", ratio=0.5, log_stats=False, collective_timeout=120)
else:
    strategy = lightning_mpi.DownpourStrategy(period=1, log_stats=False, collective_timeout=120)
world, rank = strategy.world_size, strategy.global_rank


class Task(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        with open(out / f"steps.{launch}.{rank}", "a") as log:
            log.write(f"{step}\n")
        if first_launch and rank == args.kill_rank and step == args.kill_at:
            if args.drop_host:
                hosts = Path(args.hostfile).read_text().splitlines()
                Path(args.hostfile).write_text("".join(f"{h}\n" for h in hosts if not h.startswith(args.drop_host)))
            os.kill(os.getpid(), signal.SIGKILL)
        if signal_launch and rank == args.signal_rank and step == args.signal_at:
            os.kill(os.getpid(), getattr(signal, args.signal))
        if first_launch and rank == 0 and step == args.pause_at:
            (out / "paused").write_text("")
            deadline = time.monotonic() + 60
            while not (out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    def train_dataloader(self):
        # Each rank gets samples / world of the data per epoch, in batches_per_epoch batches.
        per_rank = args.samples // world
        return DataLoader(dataset(args.samples), batch_size=per_rank // args.batches_per_epoch, shuffle=False)


checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=args.every_n_epochs, save_top_k=-1,
                             save_last=args.save_last)
trainer = pl.Trainer(
    strategy=strategy, accelerator="cpu", max_epochs=args.epochs, callbacks=[checkpoint], logger=False,
    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
)
model = Task()
trainer.fit(model)
if rank == 0:
    torch.save({"state": model.net.state_dict(), "world": world, "step": trainer.global_step}, out / "final.pt")
