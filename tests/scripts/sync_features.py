"""Run on W ranks: sync_dist logging, a torchmetrics Accuracy, all_gather/broadcast/barrier,
and a non-finite exchange that must skip the step on every rank. JSON to argv[1] from rank 0."""
import json
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
import torchmetrics  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402,F401
from tests.quiet_trainer import QUIET  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")
        self.gathered = None

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if i == 0 and self.current_epoch == 0 and RANK == W - 1 and self.trainer.strategy.world_size > 1:
            loss = loss * float("inf")  # only the last rank overflows: every rank must skip
        return loss

    def validation_step(self, batch, i):
        # Rank r logs r: the synced mean is (W-1)/2. Predictions: rank r is right on r+1 of 4 samples.
        self.log("rank_mean", float(self.global_rank), sync_dist=True)
        self.log("rank_sum", float(self.global_rank), sync_dist=True, reduce_fx="sum")
        preds = torch.zeros(4, dtype=torch.long)
        target = torch.tensor([0] * (self.global_rank + 1) + [1] * (3 - self.global_rank))[:4]
        self.acc.update(preds, target)
        self.log("acc", self.acc, on_epoch=True)
        self.gathered = self.all_gather(torch.tensor([float(self.global_rank)]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
ds = TensorDataset(torch.randn(8 * W, 4), torch.randint(0, 2, (8 * W,)))
model = Module()
trainer = pl.Trainer(
    strategy="mpi_asa16",
    max_epochs=1,
    limit_val_batches=1,
    num_sanity_val_steps=0,
    **QUIET,
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(model, DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=4))
skip_warnings = [str(w.message) for w in caught if "non-finite" in str(w.message)]
strategy = trainer.strategy
result = {
    "rank_mean": float(trainer.callback_metrics["rank_mean"]),
    "rank_sum": float(trainer.callback_metrics["rank_sum"]),
    "acc": float(trainer.callback_metrics["acc"]),
    "gathered": model.gathered.flatten().tolist(),
    "broadcast": strategy.broadcast({"from": RANK}, src=W - 1),
    "reduce_max": float(strategy.reduce(torch.tensor(float(RANK)), reduce_op="max")),
    "decision_any": strategy.reduce_boolean_decision(RANK == 0, all=False),
    "decision_all": strategy.reduce_boolean_decision(RANK == 0, all=True),
    "skipped": strategy.bound_rule.skipped_steps,
    "skip_warnings": len(skip_warnings),
    "weights_finite": bool(torch.isfinite(model.net.weight).all()),
    "global_step": trainer.global_step,
}

# Rule level: rank 0 alone has an inf gradient. Every rank must reject the step and see the
# averaged (non-finite) values in .grad, as a GradScaler would inspect them.
from lightning_mpi.comm.transport import Transport  # noqa: E402
from lightning_mpi.rules.sync import SyncRule  # noqa: E402

param = nn.Parameter(torch.zeros(10))
bound = SyncRule(exchange="asa", overlap=False).bind(Transport(COMM.Dup()), [param])
param.grad = torch.full((10,), float(RANK + 1))
if RANK == 0:
    param.grad[3] = float("inf")
accepted = bound.before_step(torch.optim.SGD([param], lr=0.1))
result["inf_on_rank0"] = {
    "accepted": accepted,
    "grad_finite": bool(torch.isfinite(param.grad).all()),
    "grad0": float(param.grad[0]),
}
bound.close()

# The slow-exchange warning (rules/exposed_warning.py), from rank 0's own clock: where the other
# ranks reach the exchange 20 ms late every step, rank 0 waits 20 ms for a step it computes in no
# time and warns; where rank 0 itself computes 20 ms and the others wait for it, it does not.
import time  # noqa: E402

from lightning_mpi.rules.exposed_warning import WARMUP, WINDOW  # noqa: E402
from lightning_mpi.rules.powersgd import PowerSGDRule  # noqa: E402


def slow_exchange_warnings(rule, late_rank_0: bool) -> int:
    """Runs WARMUP + WINDOW steps of ``rule`` with one side 20 ms late; the warnings rank 0 gave."""
    weight = nn.Parameter(torch.zeros(8, 8))
    bound = rule.bind(Transport(COMM.Dup()), [weight])
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(WARMUP + WINDOW):
            if (RANK == 0) == late_rank_0:
                time.sleep(0.02)
            weight.grad = torch.ones(8, 8)
            bound.before_step(optimizer)
            optimizer.step()
            bound.after_step(optimizer)
    bound.close()
    return sum("process fewer samples per second" in str(w.message) for w in seen)


result["slow_exchange"] = {
    "asa16, others late": slow_exchange_warnings(SyncRule(exchange="asa", wire="fp16", overlap=False), False),
    "asa16, rank 0 late": slow_exchange_warnings(SyncRule(exchange="asa", wire="fp16", overlap=False), True),
    "powersgd, others late": slow_exchange_warnings(PowerSGDRule(), False),
}

strategy.barrier()
all_results = COMM.gather(result)
if RANK == 0:
    json.dump(all_results, open(sys.argv[1], "w"))
