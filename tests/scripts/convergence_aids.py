"""Run on W ranks: lr_scaling / warmup_steps and implicit_momentum_correction through a real Trainer.

Several cases in one launch (each mpiexec costs 10-20 s of imports on a loaded 2-core machine).
For every optimizer step a callback records the learning rate the user's code sees (at batch
start), the parameters and (exchanged) gradients just before the update, the param group values
the update sees, and the parameters after it, so the test can check the update that was really
applied. Rank 0 writes JSON to argv[1]; argv[2] is a scratch directory for checkpoints and logs.
Run it as ``python -m mpi4py convergence_aids.py OUT DIR`` so that an error outside ``fit`` on
one rank aborts every rank instead of leaving them waiting in the next fit.
"""
import csv
import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402
from pytorch_lightning.loggers import CSVLogger  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

RANK, W = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
OUT, ROOT = Path(sys.argv[1]), Path(sys.argv[2])


def group_momentum(group):
    return group["betas"][0] if "betas" in group else group.get("momentum")


class Recorder(pl.Callback):
    """Per optimizer step: what user code sees, and what the update saw and did."""

    def __init__(self, save_at=None, ckpt=None):
        self.steps, self.save_at, self.ckpt = [], save_at, ckpt

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        group = trainer.optimizers[0].param_groups[0]
        self.steps.append({"user_lr": float(group["lr"]), "user_momentum": group_momentum(group)})

    def on_before_optimizer_step(self, trainer, module, optimizer):
        # runs after the closure (backward + exchange), right before the update: the aids are on
        group = optimizer.param_groups[0]
        rec = self.steps[-1]
        rec.setdefault("update_lr", float(group["lr"]))
        rec.setdefault("update_momentum", group_momentum(group))
        rec.setdefault("before", [p.detach().clone() for p in module.parameters()])
        rec.setdefault("grad", [p.grad.detach().clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        group = opt.param_groups[0]
        rec = self.steps[-1]
        rec["after"] = [p.detach().clone() for p in module.parameters()]
        rec["after_lr"] = float(group["lr"])
        rec["after_momentum"] = group_momentum(group)
        state = opt.state.get(next(module.parameters()), {})
        if "momentum_buffer" in state and state["momentum_buffer"] is not None:
            rec["buf"] = state["momentum_buffer"].clone()
        if self.save_at is not None and batch_idx == self.save_at:
            trainer.save_checkpoint(self.ckpt)  # every rank calls it; rank 0 writes


class Tiny(pl.LightningModule):
    def __init__(self, optimizer="sgd", lr=0.1, momentum=0.0, step_lr=False, nan_at=None):
        super().__init__()
        torch.manual_seed(0)  # the same start every run (rank 0's weights are broadcast anyway)
        self.net = nn.Linear(4, 1)
        self.optimizer, self.lr, self.momentum, self.step_lr, self.nan_at = optimizer, lr, momentum, step_lr, nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if batch_idx == self.nan_at and RANK == 0:
            loss = loss * float("inf")  # one rank overflows: every rank skips the step
        return loss

    def configure_optimizers(self):
        if self.optimizer == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=1)
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, betas=(self.momentum, 0.999))
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        if not self.step_lr:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(strategy, module, steps, name, **recorder_kwargs):
    torch.manual_seed(1)
    ds = TensorDataset(torch.randn(4 * W * steps, 4), torch.randn(4 * W * steps, 1))
    recorder = Recorder(**recorder_kwargs)
    trainer = pl.Trainer(
        strategy=strategy, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
        callbacks=[recorder], **dict(QUIET, logger=CSVLogger(str(ROOT), name=name, version=0)),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(ds, batch_size=4))
    return trainer, recorder.steps, [str(w.message) for w in caught if "lightning_mpi" in str(w.message)]


def applied_lr(rec):
    """The lr the SGD update really used: Δθ / (−g), the same for every element (no momentum):
    (mean, max - min, and how far apart fp32 rounding alone can put two elements' ratios: θ - lr·g
    is rounded to θ's precision, so an element's ratio is off by up to eps·|θ| / |g|).
    ``None`` for a skipped step (the closure raised before the update's hooks ran)."""
    if "grad" not in rec:
        return None
    ratios, bounds = [], []
    eps = torch.finfo(torch.float32).eps
    for b, a, g in zip(rec["before"], rec["after"], rec["grad"]):
        keep = g.abs() > 1e-6
        ratios.append(((b - a) / g)[keep])
        bounds.append((eps * torch.maximum(b.abs(), a.abs()) / g.abs())[keep])
    r, bound = torch.cat(ratios), torch.cat(bounds)
    return float(r.mean()), float(r.max() - r.min()), float(2 * bound.max())


def csv_column(name, key):
    """Rank 0's CSVLogger file (the only rank that logs); other ranks return None."""
    if RANK != 0:
        return None
    with open(ROOT / name / "version_0" / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


results = {"world_size": W}

# 1. linear scaling, 4 warm-up steps, a per-step StepLR, a checkpoint mid-warm-up, a skipped step
ckpt = ROOT / "linear.ckpt"
trainer, steps, _ = fit(lightning_mpi.SyncStrategy(lr_scaling="linear", warmup_steps=4),
                        Tiny(lr=0.1, step_lr=True, nan_at=5), 8, "linear", save_at=2, ckpt=str(ckpt))
saved = torch.load(ckpt, weights_only=False)
results["linear"] = {
    "user_lr": [s["user_lr"] for s in steps],
    "update_lr": [s.get("update_lr") for s in steps],
    "after_lr": [s["after_lr"] for s in steps],
    "applied_lr": [applied_lr(s) for s in steps],
    "skipped": trainer.strategy.bound_rule.skipped_steps,
    "final_lr": trainer.optimizers[0].param_groups[0]["lr"],
    "scheduler_last_lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
    "ckpt_lr": saved["optimizer_states"][0]["param_groups"][0]["lr"],
    "ckpt_scheduler_last_lr": saved["lr_schedulers"][0]["_last_lr"][0],
    "ckpt_global_step": saved["global_step"],
    "logged_lr_scale": csv_column("linear", "mpi/lr_scale"),
}

# 2. sqrt scaling, no warm-up, plain SGD
_, steps, _ = fit(lightning_mpi.SyncStrategy(lr_scaling="sqrt"), Tiny(lr=0.1), 2, "sqrt")
results["sqrt"] = {"applied_lr": [applied_lr(s) for s in steps], "after_lr": [s["after_lr"] for s in steps]}

# 3. sqrt scaling with LBFGS, which reads its lr *before* it calls the closure: one step,
#    Δθ = −min(1, 1/‖g‖₁)·lr·g on its first iteration
_, steps, _ = fit(lightning_mpi.SyncStrategy(lr_scaling="sqrt"), Tiny(optimizer="lbfgs", lr=0.1), 1, "lbfgs")
s = steps[0]
g1 = sum(float(g.abs().sum()) for g in s["grad"])
lr_used, spread, _ = applied_lr(s)
results["lbfgs"] = {"applied_lr": lr_used / min(1.0, 1.0 / g1), "spread": spread, "after_lr": s["after_lr"]}

# 4. momentum correction on DOWNPOUR with SGD momentum 0.9 (no commit during the 4 steps)
ckpt = ROOT / "momentum.ckpt"
_, steps, warned = fit(lightning_mpi.DownpourStrategy(period=1000, implicit_momentum_correction=True),
                       Tiny(lr=0.05, momentum=0.9), 4, "momentum", save_at=1, ckpt=str(ckpt))
used = []  # buf_k = μ·buf_{k−1} + g_k  →  μ = (buf_k − g_k) / buf_{k−1}
for prev, cur in zip(steps, steps[1:]):
    mask = prev["buf"].abs() > 1e-6
    used.append(float(((cur["buf"] - cur["grad"][0]) / prev["buf"])[mask].mean()))
results["momentum"] = {
    "user_momentum": [s["user_momentum"] for s in steps],
    "update_momentum": [s.get("update_momentum") for s in steps],
    "after_momentum": [s["after_momentum"] for s in steps],
    "momentum_from_buffers": used,
    "ckpt_momentum": torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"][0]["momentum"],
    "logged_explicit": csv_column("momentum", "mpi/momentum_explicit"),
    "logged_implicit": csv_column("momentum", "mpi/momentum_implicit"),
    "warnings": warned,
}

# 5. EAMSGD: the rule's own Nesterov δ is corrected; the user's rule keeps 0.9
trainer, _, warned = fit(lightning_mpi.EAMSGDStrategy(period=1000, implicit_momentum_correction=True), Tiny(lr=0.05), 2, "eamsgd")
results["eamsgd"] = {"rule_momentum": trainer.strategy.rule.momentum,
                     "bound_momentum": trainer.strategy.bound_rule.rule.momentum,
                     "logged_explicit": csv_column("eamsgd", "mpi/momentum_explicit"), "warnings": warned}

# 6. Adam β₁ = 0.5 < 2/3: clamped to 0, with a warning; 7. SGD without momentum: a warning, nothing changes
_, steps, warned = fit(lightning_mpi.GoSGDStrategy(p=0.5, implicit_momentum_correction=True), Tiny(optimizer="adam", lr=0.01, momentum=0.5), 2, "adam")
results["adam"] = {"update_momentum": [s.get("update_momentum") for s in steps], "after_betas0": [s["after_momentum"] for s in steps],
                   "warnings": warned}
_, steps, warned = fit(lightning_mpi.AGNStrategy(implicit_momentum_correction=True), Tiny(lr=0.05), 1, "plain")
results["plain"] = {"update_momentum": [s.get("update_momentum") for s in steps], "warnings": warned}

if RANK == 0:
    OUT.write_text(json.dumps(results, default=lambda o: repr(o)))
print(f"rank {RANK} done", flush=True)
