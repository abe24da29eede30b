"""Run on W ranks: mpi_powersgd through the Trainer and Fabric, compared with one process.

``python powersgd_train.py OUT.json [resume]`` (rank 0 writes OUT.json). Parts:

- ``full_rank``: rank = min(n, m) for every matrix, every matrix compressed, no error feedback:
  W ranks × batch B equal one process × batch W·B (the ranks start from different weights);
- ``default``: the registered name (rank 1, error feedback, warm start) trains, compresses,
  launches from the gradient hooks, and the ranks hold bitwise-identical weights after every step;
- ``nan``: a NaN loss on the last rank at one step skips that step on every rank;
- ``fabric``: ``L.Fabric(strategy="mpi_powersgd")`` trains on identical weights, and full-rank
  PowerSGD with ``fabric.no_backward_sync`` accumulation equals one process, also without
  ``no_backward_sync`` (an exchange launched after the first backward is dropped and redone);
- ``resume`` (with the ``resume`` argument): 2 epochs straight equal 1 epoch + checkpoint +
  a new fit resumed from it, bitwise (warm Q's, residuals, step count restored).
"""
import hashlib
import json
import os
import sys
import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
import lightning as L  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
import lightning_mpi.fabric  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B, STEPS, LR = 4, 6, 0.2
FULL_RANK = {"rank": 64, "min_compression_rate": 0.0, "error_feedback": False}


def digest(net):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()


class Module(pl.LightningModule):
    def __init__(self, momentum=0.0, nan_at=None):
        super().__init__()
        self.net = make_net()
        self.momentum = momentum
        self.nan_at = nan_at

    def training_step(self, batch, index):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.nan_at == index and RANK == W - 1:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


class ReplicaCheck(pl.Callback):
    def __init__(self):
        self.mismatches = 0
        self.initial = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = {k: v.clone() for k, v in pl_module.net.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.mismatches += len(set(COMM.allgather(digest(pl_module.net)))) != 1


def quiet_trainer(strategy, **kwargs):
    return pl.Trainer(strategy=strategy, **QUIET, **kwargs)


def reference(initial, batch, steps, shuffle_seed=None):
    """One process, batch W·B, the samples of all ranks of each step together."""
    net = make_net()
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    ds = dataset(batch * steps)
    if shuffle_seed is not None:  # Lightning's DistributedSampler(shuffle=True, seed=0): rank r reads perm[r::W]
        ds = torch.utils.data.Subset(ds, torch.randperm(len(ds), generator=torch.Generator().manual_seed(shuffle_seed)).tolist())
    for x, y in DataLoader(ds, batch_size=batch, shuffle=False):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def trainer_run(strategy, nan_at=None):
    torch.manual_seed(100 + RANK)  # a different initialisation on every rank
    model, check = Module(nan_at=nan_at), ReplicaCheck()
    trainer = quiet_trainer(strategy, max_epochs=1, callbacks=[check])
    trainer.fit(model, DataLoader(dataset(W * B * STEPS), batch_size=B))
    bound = trainer.strategy.bound_rule
    return model, check, trainer, bound


def part_full_rank():
    model, check, trainer, bound = trainer_run(lightning_mpi.PowerSGDStrategy(**FULL_RANK))
    ref = reference(check.initial, W * B, STEPS, shuffle_seed=0)
    compressed = sum(len(b.compressed) for b in bound.buckets)
    return {"diff": max_diff(model.net.state_dict(), ref), "mismatches": check.mismatches,
            "global_step": trainer.global_step, "compressed": compressed, "plain": sum(len(b.plain) for b in bound.buckets)}


def part_default():
    model, check, trainer, bound = trainer_run("mpi_powersgd")
    ref = reference(check.initial, W * B, STEPS, shuffle_seed=0)
    stats = bound.stats()
    return {"mismatches": check.mismatches, "global_step": trainer.global_step, "hook_launches": bound.hook_launches,
            "buckets": len(bound.buckets), "compression": stats["compression"], "steps": bound.steps,
            "diff_from_plain": max_diff(model.net.state_dict(), ref), "rule": type(trainer.strategy.rule).__name__,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def part_nan():
    model, check, trainer, bound = trainer_run(lightning_mpi.PowerSGDStrategy(rank=2), nan_at=2)
    residuals_finite = all(bool(torch.isfinite(b.residual).all()) for b in bound.buckets if b.residual is not None)
    return {"skipped": COMM.allgather(bound.skipped_steps), "mismatches": check.mismatches,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()), "residuals_finite": residuals_finite,
            "q_ready": all(b.q_ready for b in bound.buckets)}


def fabric_run(strategy, accumulate, pause=True):
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    torch.manual_seed(100 + RANK)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model, opt = fabric.setup(net, opt)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    loader = fabric.setup_dataloaders(DataLoader(dataset(W * B * STEPS * accumulate), batch_size=B, shuffle=False))
    mismatches = 0
    for index, (x, y) in enumerate(loader):
        last = (index + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=pause and not last):
            fabric.backward(nn.functional.cross_entropy(model(x), y) / accumulate)
        if last:
            opt.step()
            opt.zero_grad()
            mismatches += len(set(COMM.allgather(digest(net)))) != 1
    bound = fabric.strategy.bound_rule
    result = {"mismatches": mismatches, "exchanges": bound.steps, "hook_launches": bound.hook_launches,
              "class": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__}
    fabric.strategy.finish_training()
    return net, initial, result


def part_fabric():
    net, _, named = fabric_run("mpi_powersgd", 1)
    named["finite"] = all(bool(torch.isfinite(p).all()) for p in net.parameters())
    net, initial, full = fabric_run(lightning_mpi.fabric.PowerSGDStrategy(**FULL_RANK), 2)
    # Fabric's DistributedSampler(shuffle=False): step k of all ranks covers samples [k·2WB, (k+1)·2WB)
    full["diff"] = max_diff(net.state_dict(), reference(initial, 2 * W * B, STEPS))
    # Without no_backward_sync the hooks launch after the first micro-batch; the second backward
    # changes the gradients, so before_step must drop that exchange and redo it.
    net, initial, replay = fabric_run(lightning_mpi.fabric.PowerSGDStrategy(**FULL_RANK), 2, pause=False)
    replay["diff"] = max_diff(net.state_dict(), reference(initial, 2 * W * B, STEPS))
    return {"named": named, "full_rank_accumulate2": full, "full_rank_replayed": replay}


def resumable_fit(strategy_args, directory, mode):
    """full: 2 epochs; first: 1 epoch, then a checkpoint; resume: a new fit from it to 2 epochs."""
    torch.manual_seed(7)
    model = Module(momentum=0.9)
    trainer = quiet_trainer(lightning_mpi.PowerSGDStrategy(**strategy_args), max_epochs=1 if mode == "first" else 2)
    path = os.path.join(directory, "epoch1.ckpt")
    trainer.fit(model, DataLoader(dataset(W * B * STEPS), batch_size=B, shuffle=True),
                ckpt_path=path if mode == "resume" else None)
    if mode == "first":
        trainer.save_checkpoint(path)
    return model, trainer.strategy.bound_rule


def part_resume():
    results = {}
    # rank 2 with error feedback and warm start (state in Q's and residuals); start_step=3 crosses
    # from plain averaging into compression within the first epoch
    for label, args in {"rank2": {"rank": 2, "start_step": 3}, "no_warm_start": {"warm_start": False}}.items():
        directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
        full, _ = resumable_fit(args, directory, "full")
        resumable_fit(args, directory, "first")
        saved = torch.load(os.path.join(directory, "epoch1.ckpt"), weights_only=False)["lightning_mpi"]["state"] if RANK == 0 else None
        resumed, bound = resumable_fit(args, directory, "resume")
        results[label] = {
            "equal": COMM.allgather(digest(full.net) == digest(resumed.net)),
            "identical": len(set(COMM.allgather(digest(resumed.net)))) == 1,
            "steps": bound.steps,
        }
        if RANK == 0:
            results[label].update({
                "saved_steps": saved["steps"], "saved_ranks": len(saved["ranks"]),
                "saved_q": sum(q is not None for q in saved["q"]),
                "residual_norm": sum(float(r.norm()) for ranks in saved["ranks"] for r in ranks if r is not None),
            })
    return results


if __name__ == "__main__":
    parts = {"full_rank": part_full_rank, "default": part_default, "nan": part_nan, "fabric": part_fabric}
    if "resume" in sys.argv[2:]:
        parts["resume"] = part_resume
    out = {name: part() for name, part in parts.items()}
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
