"""Run on W ranks: the sharded optimizer (``mpi_zero``) against plain ASA, under the Trainer and Fabric.

argv: OUT.json CKPT_DIR MODE. MODE ``train`` (W = 2 or 3): each case trains with ``mpi_asa`` and
with ``mpi_zero`` from the same weights on the same data (at W = 2 also in ``bf16-mixed`` with
``LMSOffload`` on the sharded side) and reports the largest weight difference,
the share of the optimizer state this rank holds, and, for the checkpoint case, an exact resume
from a sharded checkpoint (2 epochs in one go against 1 + 1 with a save between). It leaves
``CKPT_DIR/zero/last.ckpt`` (sharded, mpi_zero) and ``CKPT_DIR/asa/last.ckpt`` (plain, mpi_asa) after
epoch 1 of the same training. MODE ``resume`` (another W): epoch 2 from those, ``mpi_zero`` from the
sharded save against ``mpi_asa`` from the plain one: the same run that changed W there.
"""

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
import pytorch_lightning as pl  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
OUT, CKPT, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
B, N = 4, 96  # batch per rank; samples per epoch (not a multiple of every W's buckets)


class Module(pl.LightningModule):
    def __init__(self, optimizer="adam"):
        super().__init__()
        self.net = make_net()
        self.optimizer = optimizer

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        first, second = self.net[0], self.net[2]
        groups = [{"params": first.parameters(), "lr": 0.01}, {"params": second.parameters(), "lr": 0.003}]
        opt = torch.optim.AdamW(groups, weight_decay=0.01) if self.optimizer == "adamw" else torch.optim.Adam(groups)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def initial_state():
    torch.manual_seed(7)  # the same start for both strategies (rank 0's is broadcast anyway)
    return make_net().state_dict()


def fit(strategy, optimizer="adam", epochs=1, clip=None, accumulate=1, ckpt_dir=None, resume=None, start=None,
        precision="32-true", callbacks=()):
    module = Module(optimizer)
    module.net.load_state_dict(start if start is not None else initial_state())
    callbacks = [*callbacks, *([pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)] if ckpt_dir else [])]
    quiet = dict(QUIET, enable_checkpointing=bool(ckpt_dir))
    trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, gradient_clip_val=clip, precision=precision,
                         accumulate_grad_batches=accumulate, callbacks=callbacks, **quiet)
    trainer.fit(module, DataLoader(dataset(N), batch_size=B, shuffle=False), ckpt_path=resume)
    return module, trainer


def weights(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def state_elements(optimizer):
    return sum(v.numel() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


def compare(sharded_callbacks=(), **kwargs):
    plain, plain_trainer = fit("mpi_asa", **kwargs)
    sharded, trainer = fit("mpi_zero", callbacks=sharded_callbacks, **kwargs)
    return {
        "diff": float((weights(plain) - weights(sharded)).abs().max()),
        "shares": COMM.allgather(state_elements(trainer.optimizers[0])),  # this rank's optimizer state
        "full": state_elements(plain_trainer.optimizers[0]),  # every rank's with plain ASA
        "identical": len(set(COMM.allgather(weights(sharded).numpy().tobytes()))) == 1,
    }


def fabric_case():
    import lightning_fabric as lf

    out = {}
    for name in ("mpi_asa", "mpi_zero"):
        fabric = lf.Fabric(strategy=name, accelerator="cpu")
        fabric.launch()
        net = make_net()
        net.load_state_dict(initial_state())
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        net, opt = fabric.setup(net, opt)
        loader = fabric.setup_dataloaders(DataLoader(dataset(N), batch_size=B, shuffle=True))
        for x, y in loader:
            fabric.backward(nn.functional.cross_entropy(net(x), y))
            fabric.clip_gradients(net, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
        path = os.path.join(CKPT, f"fabric-{name}.ckpt")
        fabric.save(path, {"model": net, "optimizer": opt})
        fabric.strategy.finish_training()
        out[name] = weights(net)
        if name == "mpi_zero":
            fresh = make_net()
            net2, opt2 = fabric.setup(fresh, torch.optim.Adam(fresh.parameters(), lr=0.01))
            restored = fabric.load(path, {"model": net2, "optimizer": opt2})
            out["fabric_load_ok"] = restored == {} and float((weights(net2) - out[name]).abs().max()) == 0.0
            out["fabric_sharded_dir"] = os.path.isdir(path)
            fabric.strategy.finish_training()
    return {"diff": float((out["mpi_asa"] - out["mpi_zero"]).abs().max()), "load_ok": out["fabric_load_ok"],
            "sharded_dir": out["fabric_sharded_dir"]}


results = {}
if MODE == "train":
    results["adam"] = compare(optimizer="adam")
    results["adamw_clip"] = compare(optimizer="adamw", clip=0.5)
    results["sgd_accumulate"] = compare(optimizer="sgd", accumulate=2)
    if W == 2:  # bf16 autocast and activations offloaded to disk (bitwise a no-op), against plain ASA in bf16
        lms = lightning_mpi.LMSOffload(target="disk", min_bytes=0, keep_last=0)
        results["bf16_lms"] = compare(optimizer="adam", precision="bf16-mixed", sharded_callbacks=[lms])
        results["bf16_lms"]["offloaded"] = lms.last_stats.offloaded_bytes if lms.last_stats else 0
    # Exact resume: 2 epochs in one go, against 1 epoch, a sharded save, then the second epoch.
    straight, _ = fit("mpi_zero", epochs=2)
    fit("mpi_zero", epochs=1, ckpt_dir=os.path.join(CKPT, "zero"))
    fit("mpi_asa", epochs=1, ckpt_dir=os.path.join(CKPT, "asa"))
    last = os.path.join(CKPT, "zero", "last.ckpt")
    resumed, _ = fit("mpi_zero", epochs=2, resume=last)
    results["resume"] = {"diff": float((weights(straight) - weights(resumed)).abs().max()),
                         "sharded_dir": os.path.isdir(last)}
    results["fabric"] = fabric_case()
else:  # the second epoch at another world size, from the first epoch's saves
    sharded, _ = fit("mpi_zero", epochs=2, resume=os.path.join(CKPT, "zero", "last.ckpt"))
    plain, _ = fit("mpi_asa", epochs=2, resume=os.path.join(CKPT, "asa", "last.ckpt"))
    results["changed_world"] = {"diff": float((weights(plain) - weights(sharded)).abs().max())}
results["world_size"] = W
if RANK == 0:
    with open(OUT, "w") as handle:
        json.dump(results, handle)
