"""Run on W ranks: train with mpi_asa_int8 / mpi_topk / mpi_onebit through a real Trainer, save a
checkpoint, resume from it, and report. JSON to argv[2] from rank 0; argv[1] is a scratch dir."""
import json
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402,F401
from tests.quiet_trainer import QUIET  # noqa: E402
from lightning_mpi import CompressedSyncStrategy  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
SCRATCH = sys.argv[1]


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Linear(33, 3))
        self.losses = []

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def trainer(strategy, epochs):
    return pl.Trainer(
        strategy=strategy, max_epochs=epochs, num_sanity_val_steps=0, **QUIET)


torch.manual_seed(0)
x = torch.randn(64 * W, 8)
y = (x[:, :3].argmax(dim=1))
ds = TensorDataset(x, y)
result = {}
for name, strategy in [
    ("mpi_asa_int8", "mpi_asa_int8"),
    ("mpi_topk", CompressedSyncStrategy(wire="topk", ratio=0.1, ratio_warmup_steps=4)),
    ("mpi_topk_mc", CompressedSyncStrategy(wire="topk", ratio=0.1, momentum_correction=True, momentum=0.5, ratio_warmup_steps=0)),
    ("mpi_onebit", "mpi_onebit"),
]:
    torch.manual_seed(1 + RANK)  # different initial weights: the strategy must broadcast rank 0's
    model = Module()
    t = trainer(strategy, 3)
    t.fit(model, DataLoader(ds, batch_size=16, shuffle=False))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    all_w = COMM.allgather(weights)
    path = os.path.join(SCRATCH, f"{name}.ckpt")
    t.save_checkpoint(path)
    bound = t.strategy.bound_rule
    saved = [r.clone() for r in bound.exchanger.residuals]
    stats = bound.stats()
    # Resume for one more epoch; the residuals must come back before the first new step.
    model2 = Module()
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            ex = trainer.strategy.bound_rule.exchanger
            seen["equal"] = all(torch.equal(a, b) for a, b in zip(saved, ex.residuals))
            seen["step"] = ex.step

    t2 = pl.Trainer(
        strategy=strategy if isinstance(strategy, str) else CompressedSyncStrategy(**{k: getattr(strategy.rule, k) for k in ("wire", "ratio", "momentum_correction", "momentum", "ratio_warmup_steps")}),
        max_epochs=4, num_sanity_val_steps=0, callbacks=[Probe()], **QUIET,
    )
    t2.fit(model2, DataLoader(ds, batch_size=16, shuffle=False), ckpt_path=path)
    result[name] = {
        "ranks_equal": all(torch.equal(all_w[0], w) for w in all_w),
        "first_loss": model.losses[0],
        "last_loss": sum(model.losses[-4:]) / 4,
        "residuals_nonzero": any(float(r.abs().sum()) > 0 for r in saved),
        "restored_equal": seen.get("equal"),
        "restored_step": seen.get("step"),
        "steps": t.global_step,
        "compression": stats.get("compression"),
        "resumed_steps": t2.global_step,
    }

if RANK == 0:
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
