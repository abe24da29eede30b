"""Train a small CNN on scikit-learn's handwritten digits (ships with the package, no download).

    mpiexec -n 2 python examples/digits.py fit --trainer.strategy=mpi_asa16
    lightning-mpi -n 2 examples/digits.py fit --trainer.strategy=mpi_allreduce --trainer.max_epochs=5
    python examples/digits.py fit --print_config          # every option, YAML

The strategy is a command-line choice (any registered ``mpi_*`` name, or a class with arguments:
``--trainer.strategy=lightning_mpi.SyncStrategy --trainer.strategy.wire=bf16 --trainer.strategy.exchange=asa``),
or comes from a YAML file (``--config examples/configs/digits_easgd.yaml``). An unknown name exits
with status 2 and the list of available names on every rank, before any rank touches MPI.
"""
from __future__ import annotations

import sys
import warnings

import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mpi  # noqa: F401  (registers the mpi_* strategy names)
from digits_data import load_digits  # examples/digits_data.py: scikit-learn's digits, stored here

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class DigitsData(pl.LightningDataModule):
    """scikit-learn's 1,797 8×8 digit images (``digits_data.py``), split 80/20 with a fixed seed."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        x, y = load_digits()
        x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        cut = int(0.8 * len(x))
        self.train_set = TensorDataset(x[order[:cut]], y[order[:cut]])
        self.val_set = TensorDataset(x[order[cut:]], y[order[cut:]])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class DigitsCNN(pl.LightningModule):
    """Two conv layers and a linear head; logs globally synced accuracy."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9, channels: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * channels * 16, 10),
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc.update(logits.argmax(1), y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


def check_strategy_name(strategy: object) -> None:
    """Exit with status 2 and the available names when ``strategy`` is an unknown name.

    Lightning's own error lists only "auto, ddp, ddp_spawn, deepspeed, ...". Every rank parses the
    same command line, so every rank exits here, symmetrically, before any collective call.
    """
    if not isinstance(strategy, str) or strategy.lower() == "auto" or strategy.lower() in StrategyRegistry:
        return
    mpi_names = sorted(name for name in StrategyRegistry if name.startswith("mpi_"))
    print(
        f"error: unknown strategy {strategy!r}. Available names: {', '.join(mpi_names)}\n"
        "  (Lightning's own registered names work too: python -c 'import lightning_mpi, pytorch_lightning as pl; "
        "print(pl.strategies.StrategyRegistry.available_strategies())'),\n"
        "  or a class with arguments: --trainer.strategy=lightning_mpi.EASGDStrategy --trainer.strategy.alpha=0.5",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(2)


class DigitsCLI(LightningCLI):
    """LightningCLI that rejects an unknown strategy name with the list of valid ones."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_strategy_name(config.get("trainer.strategy"))


def describe_strategy(strategy: object) -> str:
    """``EASGDStrategy rule=easgd period=4 alpha=0.5``: the strategy class and its rule's hyperparameters."""
    rule = getattr(strategy, "rule", None)
    if rule is None:
        return type(strategy).__name__
    hparams = " ".join(f"{k}={v!r}" for k, v in vars(rule).items() if not k.startswith("_"))
    return f"{type(strategy).__name__} rule={rule.name} {hparams}".rstrip()


def main() -> None:
    cli = DigitsCLI(
        DigitsCNN,
        DigitsData,
        trainer_defaults={"strategy": "mpi_allreduce", "max_epochs": 10, "log_every_n_steps": 10},
        save_config_kwargs={"overwrite": True},
    )
    metrics = getattr(cli.trainer, "callback_metrics", {})
    if cli.trainer.is_global_zero:
        print(f"strategy={describe_strategy(cli.trainer.strategy)}")
        if "val_acc" in metrics:
            print(f"final val_acc={float(metrics['val_acc']):.4f} world_size={cli.trainer.world_size}")


if __name__ == "__main__":
    main()
