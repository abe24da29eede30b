"""Run on W ranks: train with each strategy and compare with one process at batch W·B.

Writes JSON to argv[1] (rank 0). ``LIGHTNING_PACKAGE=lightning.pytorch`` runs the same comparison
under the unified package's Trainer (the registered names and the synchronous options). Every rank starts from a different random initialisation, so
the test also proves that setup broadcasts rank 0's weights. A callback checks after every step
that all ranks hold bitwise-identical weights.
"""
import hashlib
import importlib
import json
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402,F401
from tests.quiet_trainer import QUIET  # noqa: E402
from tiny_task import dataset, make_net, one_process_reference  # noqa: E402  (beside this script)

PACKAGE = os.environ.get("LIGHTNING_PACKAGE", "pytorch_lightning")
pl = importlib.import_module(PACKAGE)
STRATEGIES = importlib.import_module({"pytorch_lightning": "lightning_mpi", "lightning.pytorch": "lightning_mpi.lightning"}[PACKAGE])

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B, STEPS, LR = 4, 6, 0.2


class Module(pl.LightningModule):
    def __init__(self, momentum=0.0):
        super().__init__()
        self.net = make_net()
        self.momentum = momentum

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


class ReplicaCheck(pl.Callback):
    """After every step: are the weights bitwise identical on all ranks?"""

    def __init__(self):
        self.mismatches = 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        blob = b"".join(p.detach().numpy().tobytes() for p in pl_module.parameters())
        if len(set(COMM.allgather(hashlib.sha1(blob).hexdigest()))) != 1:
            self.mismatches += 1


def reference(initial, accumulate, momentum):
    """One process, batch W·B·accumulate, same samples in the same order."""
    return one_process_reference(initial, W, B, STEPS, LR, momentum, accumulate)


def run(strategy_name, kwargs=None, accumulate=1, momentum=0.0):
    torch.manual_seed(100 + RANK)  # a different initialisation on every rank
    model = Module(momentum)
    check = ReplicaCheck()
    if kwargs:
        strategy = STRATEGIES.SyncStrategy(**kwargs)
    else:
        strategy = strategy_name
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        callbacks=[check],
        **QUIET,
    )
    initial = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            initial.update({k: v.clone() for k, v in pl_module.net.state_dict().items()})

    trainer.callbacks.append(Capture())
    loader = DataLoader(dataset(W * B * STEPS * accumulate), batch_size=B, shuffle=False)
    trainer.fit(model, loader)
    ref = reference(initial, accumulate, momentum)
    diff = max((model.net.state_dict()[k] - ref[k]).abs().max().item() for k in ref)
    bound = trainer.strategy.bound_rule
    return {
        "diff": diff,
        "mismatches": check.mismatches,
        "global_step": trainer.global_step,
        "exchanges": getattr(bound, "exchange_count", None),
        "hook_launches": getattr(bound, "hook_launches", None),
        "buckets": len(getattr(bound, "buckets", [])),
        "world_size": trainer.world_size,
        "sampler_len": len(trainer.train_dataloader.sampler) if hasattr(trainer.train_dataloader, "sampler") else None,
    }


results = {}
for name in ("mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_asa_bf16"):
    results[name] = run(name)
results["weights"] = run(None, {"exchange": "asa", "average": "weights"})
results["strategy_class"] = f"{type(STRATEGIES.SyncStrategy()).__module__}.SyncStrategy on {PACKAGE}"
results["accumulate2"] = run("mpi_allreduce", accumulate=2)
if PACKAGE != "pytorch_lightning":  # the frontend is what is tested here; the options are tested below
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    sys.exit(0)
results["weights+momentum"] = run(None, {"exchange": "allreduce", "average": "weights+momentum"}, momentum=0.9)
results["no_overlap"] = run(None, {"exchange": "asa", "overlap": False})
# Tiny buckets and segments: several buckets launched from hooks, several pipelined segments each.
results["asa16_pipelined"] = run(None, {"exchange": "asa", "wire": "fp16", "bucket_mb": 0.00015, "segment_mb": 0.0001})
os.environ["LIGHTNING_MPI_RANKS_PER_NODE"] = "2"  # pretend nodes of 2 ranks on this one machine
results["topology_asa16"] = run(None, {"exchange": "asa", "wire": "fp16", "topology_aware": True, "bucket_mb": 0.0004, "segment_mb": 0.0001})
results["topology_allreduce"] = run(None, {"exchange": "allreduce", "topology_aware": True, "segment_mb": 0.0001})
if RANK == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
