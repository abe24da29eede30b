"""Run on W ranks: every way a user saves, under every family of rules, and the resume from each.

argv: OUT.json DIR MODE [FAMILY ...]. MODE ``save`` (W = 2), for each family:

- Trainer: ``trainer.save_checkpoint`` with no model attached (Lightning refuses, naming the fix),
  after ``trainer.validate`` before ``fit`` (``before.ckpt``), from a callback during ``fit``
  (``during.ckpt``, mid-epoch), by a ``ModelCheckpoint`` at each epoch's end (``mc-epoch=0.ckpt``),
  after ``fit`` (``after.ckpt``), and after ``test``/``validate``/``predict`` that follow ``fit``
  (``after_eval.ckpt``); then ``fit`` resumed from each at the same world size;
- Fabric: ``fabric.save`` after ``fabric.setup`` before any step (``fbefore.ckpt``), in the loop
  (``fduring.ckpt``) and after ``finish_training`` (``fafter.ckpt``), each with plain values beside
  the objects; then ``fabric.load`` of each into a fresh setup, and the loop resumed.

Rank 0 reads every file back in this process (a sharded directory consolidated) and reports what
it holds: the weights, the optimizer state's shapes, the rule's state. MODE ``resume`` (another W):
``fit`` and the Fabric loop resumed from the same files. The model is tiny and every run is a few
steps; what the test compares is in ``tests/strategies/test_save_paths.py``.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
import lightning_fabric as lf  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

import lightning_mpi  # noqa: E402
import lightning_mpi.lightning_fabric as mpi_fabric  # noqa: E402
from lightning_mpi.checkpoint import consolidate_checkpoint  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
OUT, ROOT, MODE = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
B, STEPS_PER_EPOCH, LR = 4, 3, 0.01  # batch per rank; 3 steps an epoch: mid-period for period=2

#: family -> (strategy class, its arguments); exchanges due within a few steps
FAMILIES = {
    "allreduce": ("SyncStrategy", {"exchange": "allreduce"}),
    "asa16": ("SyncStrategy", {"exchange": "asa", "wire": "fp16"}),
    "topk": ("CompressedSyncStrategy", {"wire": "topk", "ratio": 0.25}),
    "powersgd": ("PowerSGDStrategy", {"rank": 1, "start_step": 1, "min_compression_rate": 0.0}),
    "zero": ("SyncStrategy", {"exchange": "asa", "shard_optimizer": True, "bucket_mb": 0.0005}),
    "easgd": ("EASGDStrategy", {"period": 2}),
    "model_avg": ("ModelAveragingStrategy", {"period": 2}),
    "downpour": ("DownpourStrategy", {"period": 2}),
    "gosgd": ("GoSGDStrategy", {"p": 0.5}),
    "diloco": ("DiLoCoStrategy", {"period": 2, "outer_warmup": 0}),
    "streaming_diloco": ("StreamingDiLoCoStrategy", {"period": 4, "fragments": 2, "outer_warmup": 0}),
    "auto": ("AutoStrategy", {}),
}


def trainer_strategy(family):
    name, kwargs = FAMILIES[family]
    return getattr(lightning_mpi, name)(**kwargs)


def fabric_strategy(family):
    name, kwargs = FAMILIES[family]
    return getattr(mpi_fabric, name)(**kwargs)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)  # the same start on every rank and in every run
        self.net = make_net()

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, _):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=LR)


class SaveDuring(pl.Callback):
    """``trainer.save_checkpoint`` from a callback, in the middle of the first epoch."""

    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == 1:
            trainer.save_checkpoint(self.path)


def train_loader():
    return DataLoader(dataset(W * B * STEPS_PER_EPOCH), batch_size=B, shuffle=True)


def eval_loader():
    return DataLoader(dataset(2 * B * W), batch_size=B)


def weights(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def agree(tensor):
    """Whether every rank holds bitwise the same ``tensor``."""
    return len(set(COMM.allgather(tensor.numpy().tobytes()))) == 1


def failure(run):
    """``run()``'s result, or the exception as ``{"error": ...}`` (the same on every rank: every
    strategy call fails the run on all of them)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001  reported, the test says what was expected
        return {"error": f"{type(exc).__name__}: {exc}"[:800]}


def trainer(family, epochs, callbacks=(), checkpoints=False):
    quiet = dict(QUIET, enable_checkpointing=checkpoints)
    return pl.Trainer(strategy=trainer_strategy(family), max_epochs=epochs, callbacks=list(callbacks),
                      limit_val_batches=1, num_sanity_val_steps=0, **quiet)


def fit_resumed(family, path, epochs):
    def run():
        module = Module()
        tr = trainer(family, epochs)
        tr.fit(module, train_loader(), ckpt_path=str(path))
        w = weights(module)
        return {"weights": w.tolist(), "agree": agree(w), "step": int(tr.global_step)}

    return failure(run)


# -- reading a checkpoint back (rank 0, one process) ------------------------------------------------
def read(path):
    if os.path.isdir(path):
        return consolidate_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def optimizer_report(saved, shapes):
    """Whether ``saved`` (torch's format) holds Adam's whole state for every parameter (none before
    the first step), and its moments."""
    state = {i: s for i, s in saved["state"].items() if s}
    whole = sorted(state) == list(range(len(shapes))) and all(
        list(state[i]["exp_avg"].shape) == shape and list(state[i]["exp_avg_sq"].shape) == shape
        for i, shape in enumerate(shapes)
    )
    moments = torch.cat([state[i][k].reshape(-1) for i in sorted(state) for k in ("exp_avg", "exp_avg_sq")]) \
        if state else torch.zeros(0)
    steps = sorted({float(state[i]["step"]) for i in state})
    return {"whole": whole, "moments": moments.tolist(), "steps": steps}


def rule_report(entry):
    if entry is None:
        return None
    state = entry["state"]
    out = {"rule": entry["rule"], "world_size": entry["world_size"], "keys": sorted(state)}
    inner = state.get("inner", state)  # mpi_auto: its arm's
    if "clock" in inner:
        out["clock"] = int(inner["clock"])
    if "ranks" in inner:
        out["ranks"] = len(inner["ranks"])
        if inner["ranks"] and "weight" in inner["ranks"][0]:
            out["weight_sum"] = float(sum(r["weight"] for r in inner["ranks"]))
    if "center" in inner:
        out["center"] = inner["center"].reshape(-1).tolist()
    return out


def trainer_file_report(path, shapes):
    ckpt = read(path)
    weights = torch.cat([v.reshape(-1) for v in ckpt["state_dict"].values()]).tolist()
    report = {"sharded": os.path.isdir(path), "weights": weights, "global_step": int(ckpt.get("global_step", -1)),
              "rule": rule_report(ckpt.get("lightning_mpi"))}
    optimizers = ckpt.get("optimizer_states", [])
    report["optimizers"] = [optimizer_report(o, shapes) for o in optimizers]
    return report


def fabric_file_report(path, shapes):
    ckpt = read(path)
    report = {"sharded": os.path.isdir(path), "keys": sorted(ckpt), "rule": rule_report(ckpt.get("lightning_mpi"))}
    report["weights"] = torch.cat([v.reshape(-1) for v in ckpt["model"].values()]).tolist()
    if "optimizer" in ckpt:
        report["optimizer"] = optimizer_report(ckpt["optimizer"], shapes)
    return report


# -- the Trainer's save paths -------------------------------------------------------------------------
def trainer_saves(family, out):
    d = ROOT / family
    module = Module()
    tr = trainer(family, 2, callbacks=[SaveDuring(d / "during.ckpt"),
                                       pl.callbacks.ModelCheckpoint(dirpath=d, filename="mc-{epoch}", save_top_k=-1)],
                 checkpoints=True)
    out["validate_before"] = failure(lambda: tr.validate(module, eval_loader()) and None)
    out["save_before"] = failure(lambda: tr.save_checkpoint(d / "before.ckpt"))
    out["fit"] = failure(lambda: tr.fit(module, train_loader()))
    w = weights(module)
    out["final"] = {"weights": w.tolist(), "agree": agree(w), "step": int(tr.global_step)}
    out["save_after"] = failure(lambda: tr.save_checkpoint(d / "after.ckpt"))
    out["test"] = failure(lambda: tr.test(module, eval_loader()) and None)
    out["validate"] = failure(lambda: tr.validate(module, eval_loader()) and None)
    out["predict"] = failure(lambda: len(tr.predict(module, eval_loader())))
    out["eval_left_weights"] = bool(torch.equal(weights(module), w))
    out["save_after_eval"] = failure(lambda: tr.save_checkpoint(d / "after_eval.ckpt"))
    COMM.Barrier()
    for name, epochs in (("before", 2), ("mc-epoch=0", 2), ("during", 2), ("after", 3), ("mc-epoch=0", 3)):
        out[f"resume_{name}_{epochs}"] = fit_resumed(family, d / f"{name}.ckpt", epochs)
    if RANK == 0:
        shapes = [list(p.shape) for p in Module().parameters()]
        out["files"] = {name: failure(lambda name=name: trainer_file_report(d / f"{name}.ckpt", shapes))
                        for name in ("before", "during", "mc-epoch=0", "mc-epoch=1", "after", "after_eval")}


# -- Fabric's save paths --------------------------------------------------------------------------------
def fabric_batches(first, last):
    """Step k's batch on this rank: samples [(k·W + r)·B, +B) of one fixed order (no sampler)."""
    data = dataset(W * B * 6)
    return [(data.tensors[0][(k * W + RANK) * B:(k * W + RANK + 1) * B],
             data.tensors[1][(k * W + RANK) * B:(k * W + RANK + 1) * B]) for k in range(first, last)]


def fabric_setup(fabric, seed=3):
    torch.manual_seed(seed)
    net = make_net()
    return fabric.setup(net, torch.optim.Adam(net.parameters(), lr=LR))


def fabric_train(fabric, net, opt, first, last, save=None):
    for k, (x, y) in zip(range(first, last), fabric_batches(first, last), strict=True):
        if save is not None and k == save[0]:
            fabric.save(save[1], {"model": net, "optimizer": opt, "step": k, "epoch": 1, "note": "kept"})
        fabric.backward(nn.functional.cross_entropy(net(x), y))
        opt.step()
        opt.zero_grad()


def fabric_saves(family, out):
    d = ROOT / family
    fabric = lf.Fabric(strategy=fabric_strategy(family), accelerator="cpu")
    fabric.launch()

    def first_run():
        torch.manual_seed(3)
        raw = make_net()  # before fabric.setup: no rule bound yet
        fabric.save(d / "fraw.ckpt", {"model": raw, "step": 0, "epoch": 0, "note": "kept"})
        net, opt = fabric_setup(fabric)
        fabric.save(d / "fbefore.ckpt", {"model": net, "optimizer": opt, "step": 0, "epoch": 0, "note": "kept"})
        fabric_train(fabric, net, opt, 0, 6, save=(3, d / "fduring.ckpt"))
        fabric.strategy.finish_training()
        fabric.save(d / "fafter.ckpt", {"model": net, "optimizer": opt, "step": 6, "epoch": 2, "note": "kept"})
        w = weights(net)
        return {"weights": w.tolist(), "agree": agree(w)}

    out["fabric_first"] = failure(first_run)
    COMM.Barrier()
    for name in ("fraw", "fbefore", "fduring", "fafter"):
        out[f"fabric_load_{name}"] = fabric_resumed(fabric, d / f"{name}.ckpt")
    # weights without the rule's state, loaded into a running rule: it ends on them
    out["fabric_hold_fraw"] = fabric_resumed(fabric, d / "fraw.ckpt", train=False)
    if RANK == 0:
        shapes = [list(p.shape) for p in make_net().parameters()]
        out["fabric_files"] = {name: failure(lambda name=name: fabric_file_report(d / f"{name}.ckpt", shapes))
                               for name in ("fraw", "fbefore", "fduring", "fafter")}


def fabric_resumed(fabric, path, train=True):
    """``fabric.load`` into a fresh setup (other initial weights, as a new process would have), then
    the loop to step 6 from the step it restored (``train=False``: none)."""

    def run():
        net, opt = fabric_setup(fabric, seed=4)
        state = {"model": net, "optimizer": opt, "step": -1, "epoch": -1}
        if "fraw" in str(path):
            state = {"model": net, "step": -1, "epoch": -1}  # what it holds
        remainder = fabric.load(path, state)
        step = state["step"]
        if train and isinstance(step, int) and 0 <= step < 6:
            fabric_train(fabric, net, opt, step, 6)
        fabric.strategy.finish_training()
        w = weights(net)
        return {"step": step, "epoch": state["epoch"], "remainder": sorted(remainder), "weights": w.tolist(),
                "agree": agree(w)}

    return failure(run)


# -- the same files at another world size ---------------------------------------------------------------
def resumes_elsewhere(family, out):
    d = ROOT / family
    for name in ("during", "mc-epoch=0", "after"):
        out[f"resume_{name}_3"] = fit_resumed(family, d / f"{name}.ckpt", 3)
    fabric = lf.Fabric(strategy=fabric_strategy(family), accelerator="cpu")
    fabric.launch()
    for name in ("fraw", "fduring", "fafter"):
        out[f"fabric_load_{name}"] = fabric_resumed(fabric, d / f"{name}.ckpt")


results = {"world_size": W, "families": {}}
if MODE == "save":
    results["save_without_model"] = failure(lambda: pl.Trainer(strategy="mpi_allreduce", **QUIET).save_checkpoint(
        ROOT / "nothing.ckpt"))
for family in sys.argv[4:] or list(FAMILIES):
    out = results["families"][family] = {}
    if MODE == "save":
        trainer_saves(family, out)
        fabric_saves(family, out)
    else:
        resumes_elsewhere(family, out)
    COMM.Barrier()
if RANK == 0:
    with open(OUT, "w") as handle:
        json.dump(results, handle)
