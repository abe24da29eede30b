"""Run on W ranks: argv[1] in {full, first, resume}, argv[2] a directory.

full: 2 epochs straight. first: 1 epoch, then a checkpoint. resume: load it, train epoch 2.
Rank 0 saves the final flat weights to <dir>/<mode>.pt.
"""
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

MODE, OUT = sys.argv[1], Path(sys.argv[2])
torch.manual_seed(0)
data = TensorDataset(torch.randn(96, 8), torch.randint(0, 3, (96,)))


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


torch.manual_seed(1)
model = Module()
trainer = pl.Trainer(
    strategy=sys.argv[3] if len(sys.argv) > 3 else "mpi_allreduce",
    max_epochs=1 if MODE == "first" else 2,
    **QUIET,
)
trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=str(OUT / "epoch1.ckpt") if MODE == "resume" else None)
if MODE == "first":
    trainer.save_checkpoint(OUT / "epoch1.ckpt")
if trainer.is_global_zero:
    torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), OUT / f"{MODE}.pt")
