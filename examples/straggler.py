"""One slow rank: an asynchronous rule keeps the fast ranks working, a synchronous rule makes them wait.

    lightning-mpi -n 2 examples/straggler.py                                   # mpi_adag vs mpi_asa, 12 s each
    lightning-mpi -n 2 examples/straggler.py --strategies mpi_downpour,mpi_asa --seconds 10
    mpiexec -n 2 python examples/straggler.py --slowdown 5

The digits CNN from ``examples/digits.py`` trains for a fixed wall-clock budget
(``Trainer(max_time=...)``) under each strategy in turn. Every training step sleeps ``--delay``
seconds; the slow rank (the last one, by default) sleeps ``--slowdown`` times as long, which makes
it about that many times slower. The script prints, per strategy, how many samples each rank
processed within the budget and the accuracy of the final weights on the held-out 20%. One run
with ``--seconds 8`` on a 2-core machine shared with other jobs (so the counts are noisy):

    mpi_adag      budget=8s samples per rank=[3659, 1854] total=5513 val_acc=0.9417
    mpi_asa       budget=8s samples per rank=[2317, 2317] total=4634 val_acc=0.9417

With a synchronous rule every step waits for the slowest rank, so all ranks process the same,
slow, number of samples. With an asynchronous rule the fast ranks keep committing to the
parameter server while the straggler catches up. Validation, checkpointing and logging are off
during training: an epoch-end validation with ``sync_dist=True`` would be one more barrier.
"""
from __future__ import annotations

import argparse
import time
import warnings

import pytorch_lightning as pl
import torch
from digits import DigitsCNN, DigitsData  # examples/ is on sys.path when this script runs
from mpi4py import MPI
from torch import nn

import lightning_mpi  # noqa: F401  (registers the mpi_* strategy names)

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class StragglingCNN(DigitsCNN):
    """DigitsCNN that sleeps ``delay`` seconds in every training step and counts its samples."""

    def __init__(self, delay: float = 0.0, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__(lr=lr, momentum=momentum)
        self.delay = delay
        self.samples = 0

    def training_step(self, batch, batch_idx):
        time.sleep(self.delay)
        x, y = batch
        self.samples += len(x)
        return nn.functional.cross_entropy(self.net(x), y)


@torch.no_grad()
def accuracy(model: DigitsCNN, data: DigitsData) -> float:
    x, y = data.val_set.tensors
    model.eval()
    return float((model.net(x).argmax(1) == y).float().mean())


def run(strategy: str, seconds: float, delay: float, slowdown: float, slow_rank: int, seed: int) -> None:
    comm = MPI.COMM_WORLD
    pl.seed_everything(seed, verbose=False)
    data = DigitsData(batch_size=32, seed=seed)
    data.setup("fit")
    model = StragglingCNN(delay=delay * (slowdown if comm.rank == slow_rank else 1.0))
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=-1,
        max_time={"seconds": seconds},
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=data.train_dataloader())
    counts = comm.gather(model.samples, root=0)
    acc = accuracy(model, data)  # every rank holds the final (consensus) weights
    if comm.rank == 0:
        print(f"{strategy:<13} budget={seconds:g}s samples per rank={counts} total={sum(counts)} val_acc={acc:.4f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="mpi_adag,mpi_asa", help="comma-separated strategy names, run in turn")
    parser.add_argument("--seconds", type=float, default=12.0, help="wall-clock budget per strategy (max_time)")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds every step sleeps on a normal rank")
    parser.add_argument("--slowdown", type=float, default=3.0, help="the slow rank sleeps this many times longer")
    parser.add_argument("--slow-rank", type=int, default=-1, help="which rank straggles (default: the last)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    slow_rank = args.slow_rank % comm.size
    if comm.rank == 0:
        print(f"world_size={comm.size} slow_rank={slow_rank} delay={args.delay}s slowdown={args.slowdown}x", flush=True)
    for strategy in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        run(strategy, args.seconds, args.delay, args.slowdown, slow_rank, args.seed)


if __name__ == "__main__":
    main()
