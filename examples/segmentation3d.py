"""3D segmentation on synthetic volumes, with activation offload (LMSOffload) and MPI data parallelism.

IBM's Large Model Support use case in miniature: a 3D U-Net whose activations, not its weights,
fill memory. ``LMSOffload`` moves the tensors saved for backward out of the device during forward
and brings them back ahead of backward; ``mpi_asa`` averages gradients across ranks.

    mpiexec -n 2 python examples/segmentation3d.py                      # mpi_asa, 2 ranks
    mpiexec -n 2 python examples/segmentation3d.py --side 48 --offload disk --directory /scratch/lms
    python examples/segmentation3d.py --strategy auto --offload none     # one process, no offload

``--offload auto`` (the default) picks ``cpu`` (pinned host memory) on a GPU and ``disk`` on a
CPU-only machine, where the disk tier is what lowers peak RSS.
"""
from __future__ import annotations

import argparse
import warnings

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_mpi  # registers the mpi_* strategy names; lightning_mpi.LMSOffload is the callback

warnings.filterwarnings("ignore", ".*does not have many workers.*")


class SyntheticVolumes(Dataset):
    """Noisy volumes with a few bright ellipsoids; the label marks voxels inside them. Item ``i``
    is a pure function of ``(seed, i)``, so every rank sees the same dataset."""

    def __init__(self, size: int, side: int, seed: int = 0) -> None:
        self.size, self.side, self.seed = size, side, seed
        axis = torch.linspace(-1.0, 1.0, side)
        self.grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"))  # (3, D, D, D)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        mask = torch.zeros(self.grid.shape[1:], dtype=torch.bool)
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            center = torch.rand(3, 1, 1, 1, generator=g) * 1.2 - 0.6
            radii = torch.rand(3, 1, 1, 1, generator=g) * 0.3 + 0.15
            mask |= (((self.grid - center) / radii) ** 2).sum(0) <= 1.0
        image = mask.float() + 0.6 * torch.randn(mask.shape, generator=g)
        return image.unsqueeze(0), mask.long()


def conv_block(cin: int, cout: int, convs: int = 2) -> nn.Sequential:
    """``convs`` x (3x3x3 conv, BatchNorm, in-place ReLU)."""
    layers: list[nn.Module] = []
    for i in range(convs):
        layers += [nn.Conv3d(cin if i == 0 else cout, cout, 3, padding=1, bias=False), nn.BatchNorm3d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class UNet3d(nn.Module):
    """A two-level 3D U-Net (Cicek et al. 2016, shrunk). Input sides must be multiples of 4.
    ``convs`` per block: 2 as in the paper; more makes the model more activation-dominated (saved
    activations grow with depth, the working set of one layer does not)."""

    def __init__(self, channels: int = 8, in_channels: int = 1, classes: int = 2, convs: int = 2) -> None:
        super().__init__()
        c = channels
        self.enc1, self.enc2 = conv_block(in_channels, c, convs), conv_block(c, 2 * c, convs)
        self.bottom = conv_block(2 * c, 4 * c, convs)
        self.up2, self.dec2 = nn.ConvTranspose3d(4 * c, 2 * c, 2, stride=2), conv_block(4 * c, 2 * c, convs)
        self.up1, self.dec1 = nn.ConvTranspose3d(2 * c, c, 2, stride=2), conv_block(2 * c, c, convs)
        self.head = nn.Conv3d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.enc1(x)
        s2 = self.enc2(nn.functional.max_pool3d(s1, 2))
        b = self.bottom(nn.functional.max_pool3d(s2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), s2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), s1], dim=1))
        return self.head(d1)


class Segmentation3d(pl.LightningModule):
    """Cross-entropy + soft Dice on the foreground class; logs the validation Dice score."""

    def __init__(self, channels: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = UNet3d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y) + (1.0 - soft_dice(logits, y))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/dice", hard_dice(self(x), y), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def soft_dice(logits: torch.Tensor, target: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    p = logits.float().softmax(1)[:, 1]
    t = target.float()
    return (2 * (p * t).sum() + eps) / (p.sum() + t.sum() + eps)


def hard_dice(logits: torch.Tensor, target: torch.Tensor, eps: float = 1.0) -> torch.Tensor:
    p = (logits.argmax(1) == 1).float()
    t = target.float()
    return (2 * (p * t).sum() + eps) / (p.sum() + t.sum() + eps)


def make_offload(kind: str, directory: str | None, min_bytes: int) -> list[pl.Callback]:
    if kind == "none":
        return []
    if kind == "auto":
        kind = "cpu" if torch.cuda.is_available() else "disk"
    return [lightning_mpi.LMSOffload(target=kind, directory=directory if kind == "disk" else None, min_bytes=min_bytes)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="mpi_asa", help="a registered strategy name (mpi_asa, mpi_allreduce, ..., or auto)")
    parser.add_argument("--offload", default="auto", choices=["auto", "cpu", "disk", "none"])
    parser.add_argument("--directory", default=None, help="spill directory for --offload disk (default: a temporary one)")
    parser.add_argument("--min-bytes", type=int, default=256 * 1024, help="smaller saved tensors stay resident")
    parser.add_argument("--side", type=int, default=32, help="volume side in voxels (a multiple of 4)")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--train-size", type=int, default=16, help="training volumes (split over ranks)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    args = parser.parse_args(argv)
    if args.side % 4:
        parser.error(f"--side={args.side} must be a multiple of 4 (two 2x poolings)")

    torch.manual_seed(0)
    train = DataLoader(SyntheticVolumes(args.train_size, args.side, seed=0), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(SyntheticVolumes(4, args.side, seed=1), batch_size=args.batch_size)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="auto",
        max_epochs=args.epochs,
        precision=args.precision,
        callbacks=make_offload(args.offload, args.directory, args.min_bytes),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(Segmentation3d(args.channels), train, val)
    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        mib = float(metrics.get("lms/offloaded_bytes", 0.0)) / 2**20
        print(
            f"world_size={trainer.world_size} strategy={args.strategy} offload={args.offload} "
            f"val_dice={float(metrics.get('val/dice', float('nan'))):.3f} "
            f"train_loss={float(metrics.get('train/loss', float('nan'))):.3f} offloaded_per_step={mib:.1f} MiB"
        )


if __name__ == "__main__":
    main()
