"""The digits classifier as a Fabric loop: ``import lightning as L``, ``L.Fabric(strategy="mpi_...")``.

    mpiexec -n 2 python examples/fabric_digits.py --strategy mpi_asa16
    mpiexec -n 4 python examples/fabric_digits.py --strategy mpi_gosgd --epochs 8
    python examples/fabric_digits.py                      # one process, world size 1

What lightning_mpi does in this loop: ``fabric.setup`` gives every rank rank 0's weights and binds
the exchange rule; ``fabric.backward`` starts the synchronous exchanges during backward (not
inside ``fabric.no_backward_sync``); ``optimizer.step()`` finishes them and updates;
``fabric.all_reduce`` averages the accuracy over MPI; and ``fabric.strategy.finish_training()`` leaves
the rule's consensus weights on every rank (the center for elastic and parameter-server rules, the
gossip consensus), since a Fabric loop has no ``on_train_end``. ``--checkpoint`` saves that final
model after it, with the optimizer and the state the rule ended with, so that a run can also go on
from it (docs/checkpoints.md). Rank 0 prints one line per epoch and ``final accuracy <value>``.
"""
from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mpi  # registers the mpi_* names with lightning.fabric
from digits_data import load_digits  # examples/digits_data.py: scikit-learn's digits, stored here

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 8x8 digit images (``digits_data.py``), split 80/20 with a fixed seed."""
    x, y = load_digits()
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="mpi_allreduce", choices=sorted(lightning_mpi.STRATEGIES))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default=None,
                        help="fabric.save the final (consensus) model and the optimizer here, after finish_training")
    args = parser.parse_args()

    fabric = L.Fabric(strategy=args.strategy, accelerator="cpu")
    fabric.launch()
    fabric.seed_everything(0)
    train, test = digits()
    net = make_model()
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    train_loader, test_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.batch_size, shuffle=True), DataLoader(test, batch_size=256)
    )
    for epoch in range(args.epochs):
        model.train()
        for index, (x, y) in enumerate(train_loader):
            updating = (index + 1) % args.accumulate == 0
            with fabric.no_backward_sync(model, enabled=not updating):
                fabric.backward(nn.functional.cross_entropy(model(x), y) / args.accumulate)
            if updating:
                optimizer.step()
                optimizer.zero_grad()
        fabric.print(f"epoch {epoch}: accuracy {evaluate(fabric, model, test_loader):.3f}")
    fabric.strategy.finish_training()  # every rank now holds the rule's consensus weights
    fabric.print(f"final accuracy {evaluate(fabric, model, test_loader):.3f}")
    if args.checkpoint:
        fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer})


@torch.no_grad()
def evaluate(fabric: L.Fabric, model: nn.Module, loader: DataLoader) -> float:
    """Accuracy over every rank's shard of the test set (sums reduced over MPI)."""
    model.eval()
    counts = torch.zeros(2)
    for x, y in loader:
        counts += torch.tensor([float((model(x).argmax(1) == y).sum()), float(len(y))])
    model.train()
    correct, total = fabric.all_reduce(counts, reduce_op="sum").tolist()
    return correct / total


if __name__ == "__main__":
    main()
