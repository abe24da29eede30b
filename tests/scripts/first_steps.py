"""Run on 2 ranks: what a new user's first script meets (issue 27), in one launch.

``python first_steps.py OUT.json``; rank 0 writes OUT.json:

- ``seed``: nothing to write; ``pl.seed_everything()`` runs first, before any Trainer, and the test
  reads the job's output (one "No seed found", one "[rank: r] Seed set to 0" per rank);
- ``flags``: for each ``devices=``/``num_nodes=`` case, the Trainer's ``num_devices``/``num_nodes``
  and ``world_size``, or the error; the same for Fabric;
- ``evaluation``: the samples ``trainer.test``/``validate`` evaluated on all ranks, and the warnings
  each rank recorded, for 301 samples (a ``DistributedSampler`` pads them) and for a custom batch
  sampler of 5 batches (dealt whole, the last one dropped).
"""

import json
import sys
import warnings

import pytorch_lightning as pl

import lightning_mpi  # registers the names, and tells Lightning the rank from PMI_RANK

pl.seed_everything()  # before any Trainer exists: "No seed found" once, "Seed set to 0" labelled per rank

import lightning_fabric  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.quiet_trainer import QUIET  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()


def outcome(make):
    """What ``make()`` gave: the frontend's view of the layout, or the error's type and message."""
    try:
        made = make()
    except ValueError as error:
        return {"error": str(error)}
    strategy = made.strategy
    return {
        "num_devices": getattr(made, "num_devices", len(strategy.parallel_devices)),
        "num_nodes": getattr(made, "num_nodes", strategy.num_nodes),
        "world_size": made.world_size,
    }


def trainer(**flags):
    return lambda: pl.Trainer(strategy="mpi_asa16", accelerator="cpu", **flags, **QUIET)


def fabric(**flags):
    return lambda: lightning_fabric.Fabric(strategy="mpi_asa16", accelerator="cpu", **flags)


def flag_cases():
    return {
        "unset": outcome(trainer()),
        "devices=auto": outcome(trainer(devices="auto")),
        "devices=2": outcome(trainer(devices=2)),
        "devices=1": outcome(trainer(devices=1)),  # what "auto" resolves to on the CPU
        "num_nodes=1": outcome(trainer(num_nodes=1)),
        "devices=4": outcome(trainer(devices=4)),
        "num_nodes=3": outcome(trainer(num_nodes=3)),
        "instance devices=4": outcome(
            lambda: pl.Trainer(strategy=lightning_mpi.SyncStrategy(), accelerator="cpu", devices=4, **QUIET)
        ),
        "fabric unset": outcome(fabric()),
        "fabric devices=4": outcome(fabric(devices=4)),
        "fabric num_nodes=3": outcome(fabric(num_nodes=3)),
    }


class Counter(pl.LightningModule):
    """Counts the samples each evaluation step sees."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen = 0

    def test_step(self, batch, batch_idx):
        self.seen += len(batch[0])

    validation_step = test_step


class ThreeAtATime:
    """A custom batch sampler (not a torch BatchSampler): Lightning's ddp cannot shard it."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter([list(range(i, min(i + 3, self.n))) for i in range(0, self.n, 3)])

    def __len__(self):
        return (self.n + 2) // 3


def evaluate(run, loader):
    """Samples evaluated over all ranks, and this rank's lightning_mpi-relevant warnings."""
    model = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(pl.Trainer(strategy="mpi_asa16", accelerator="cpu", **QUIET), model, loader)
    messages = [str(w.message) for w in caught if "evaluated" in str(w.message)]
    categories = sorted({type(w.message).__name__ for w in caught if "evaluated" in str(w.message)})
    return {"seen": COMM.allreduce(model.seen), "warnings": COMM.gather(messages), "categories": categories}


def evaluation_cases():
    data = TensorDataset(torch.randn(301, 4))
    return {
        "test 301": evaluate(lambda t, m, d: t.test(m, dataloaders=d, verbose=False), DataLoader(data, batch_size=16)),
        "validate 301": evaluate(
            lambda t, m, d: t.validate(m, dataloaders=d, verbose=False), DataLoader(data, batch_size=16)
        ),
        "test 300": evaluate(
            lambda t, m, d: t.test(m, dataloaders=d, verbose=False),
            DataLoader(TensorDataset(torch.randn(300, 4)), batch_size=16),
        ),
        "test custom batches": evaluate(
            lambda t, m, d: t.test(m, dataloaders=d, verbose=False),
            DataLoader(TensorDataset(torch.randn(15, 4)), batch_sampler=ThreeAtATime(15)),
        ),
    }


def main():
    results = {"flags": flag_cases(), "evaluation": evaluation_cases()}
    gathered = COMM.gather(results["flags"])
    if RANK == 0:
        results["flags_agree"] = all(ranks == gathered[0] for ranks in gathered)
        with open(sys.argv[1], "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
