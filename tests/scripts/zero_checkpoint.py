"""Sharded checkpoints of the ZeRO rule: save at one world size, resume at the same or another.

``mpiexec -n 3 python zero_checkpoint.py save DIR`` trains two copies of :class:`ZeroNet` for
``STEPS`` steps from the same start: A with plain ASA and the full optimizer, B with ``ZeroRule`` and
the optimizer sharded. A's checkpoint is written by rank 0 as Lightning's ``ddp`` would
(``DIR/plain.ckpt``), B's by every rank at once (``DIR/sharded.ckpt``, a directory). Both go on for
``STEPS`` more steps, and so does C, a fresh copy of B resumed from the sharded checkpoint in the
same job (exact resume at the same W).

``mpiexec -n 2 python zero_checkpoint.py resume DIR`` resumes A from the plain checkpoint, B from
the sharded one (written at W = 3: resharded) and D, a ZeRO copy, from A's plain checkpoint, and
runs ``STEPS`` steps: B and D must equal A, the run that changed W there.

Rank 0 writes ``DIR/<phase>.json``. The global batch per step is the same at every W.
"""
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

import pytorch_lightning as pl  # noqa: E402

from lightning_mpi.checkpoint import is_sharded_checkpoint, load_sharded, save_sharded  # noqa: E402
from lightning_mpi.comm.transport import Transport  # noqa: E402
from lightning_mpi.rules.sync import SyncRule  # noqa: E402
from lightning_mpi.rules.zero import ZeroRule  # noqa: E402
from zero_task import ZeroNet  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
T = Transport(COMM, timeout=120)
GLOBAL_BATCH, STEPS = 12, 3
PHASE, DIR = sys.argv[1], Path(sys.argv[2])


def batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
    per = GLOBAL_BATCH // W
    return x[RANK * per : (RANK + 1) * per], y[RANK * per : (RANK + 1) * per]


class Copy:
    """One model with its rule, optimizer and scheduler, driven as the strategies drive them."""

    def __init__(self, zero: bool) -> None:
        self.model = ZeroNet()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.rule = (ZeroRule(bucket_mb=0.0002) if zero else SyncRule(exchange="asa")).bind(T, params)
        [self.optimizer], [self.scheduler] = self.model.configure_optimizers()
        if zero:
            self.rule.shard_optimizer(self.optimizer)
        self.zero = zero
        self.step_count = 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x, y = batch(self.step_count)
            nn.functional.mse_loss(self.model(x), y).backward()
            assert self.rule.before_step(self.optimizer)
            if self.zero:
                self.rule.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 0.5)
            self.optimizer.step()
            self.rule.after_step(self.optimizer)
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.step_count += 1

    def checkpoint(self) -> dict:
        """What Lightning's checkpoint connector would hand the strategy."""
        optimizer_state = self.rule.optimizer_state() if self.zero else self.optimizer.state_dict()
        return {
            "epoch": 0, "global_step": self.step_count, "pytorch-lightning_version": pl.__version__,
            "state_dict": self.model.state_dict(), "optimizer_states": [optimizer_state],
            "lr_schedulers": [self.scheduler.state_dict()], "hyper_parameters": dict(self.model.hparams),
            "hparams_name": "kwargs",
        }

    def restore(self, checkpoint: dict) -> None:
        """Lightning's order: module weights, then (after setup) optimizer and scheduler states."""
        self.model.load_state_dict(checkpoint["state_dict"])
        if self.zero:
            self.rule.load_optimizer_state(checkpoint["optimizer_states"][0])
        else:
            self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        self.scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
        self.step_count = checkpoint["global_step"]


def weights(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


results = {"world_size": W}
if PHASE == "save":
    a, b = Copy(zero=False), Copy(zero=True)
    a.train(STEPS)
    b.train(STEPS)
    if RANK == 0:
        DIR.mkdir(parents=True, exist_ok=True)
        torch.save(a.checkpoint(), DIR / "plain.ckpt")
    COMM.Barrier()
    save_sharded(DIR / "sharded.ckpt", b.checkpoint(), T)
    save_sharded(DIR / "sharded.ckpt", b.checkpoint(), T)  # a second save replaces the first
    results["full_state_a"] = str(DIR / "plain.ckpt")
    c = Copy(zero=True)
    c.restore(load_sharded(DIR / "sharded.ckpt"))
    results["saved_weights_diff"] = max_diff(weights(a.model), weights(b.model))
    a.train(STEPS)
    b.train(STEPS)
    c.train(STEPS)
    results["same_w_resume_diff"] = max_diff(weights(b.model), weights(c.model))
    results["zero_vs_plain_diff"] = max_diff(weights(a.model), weights(b.model))
    results["entries"] = sorted(os.listdir(DIR))
    results["modes"] = {name: oct(os.stat(DIR / "sharded.ckpt" / name).st_mode & 0o777)
                        for name in [".", *sorted(os.listdir(DIR / "sharded.ckpt"))]}
    results["is_sharded"] = is_sharded_checkpoint(DIR / "sharded.ckpt")
    # the state each rank wrote: its shard, about 1/W of the whole
    results["shard_bytes"] = json.loads((DIR / "sharded.ckpt" / "manifest.json").read_text())["bytes"]
elif PHASE == "resume":
    a, b, d = Copy(zero=False), Copy(zero=True), Copy(zero=True)
    plain = torch.load(DIR / "plain.ckpt", weights_only=False)
    a.restore(plain)
    b.restore(load_sharded(DIR / "sharded.ckpt"))
    d.restore(plain)
    results["restored_weights_diff"] = max_diff(weights(a.model), weights(b.model))
    results["restored_lr"] = [[g["lr"] for g in c.optimizer.param_groups] for c in (a, b, d)]
    a.train(STEPS)
    b.train(STEPS)
    d.train(STEPS)
    results["resharded_diff"] = max_diff(weights(a.model), weights(b.model))
    results["from_plain_diff"] = max_diff(weights(a.model), weights(d.model))
    full_b = b.rule.gather_optimizer_state()
    full_a = a.optimizer.state_dict()
    results["state_diff"] = max(
        (full_a["state"][i][k].double() - v.double()).abs().max().item()
        for i, s in full_b["state"].items() for k, v in s.items() if v.dim() > 0
    )
else:
    raise SystemExit(f"unknown phase {PHASE!r}")

if RANK == 0:
    (DIR / f"{PHASE}.json").write_text(json.dumps(results, indent=1))
