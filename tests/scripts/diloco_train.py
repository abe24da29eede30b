"""Run on W ranks: DiLoCo and Streaming DiLoCo through the Trainer and Fabric (rank 0 writes argv[1]).

- ``model_avg``: DiLoCo with ``outer_lr=1, outer_momentum=0`` against ``mpi_model_avg`` (same period);
- ``streaming_as_diloco``: Streaming DiLoCo with one fragment, τ = 0, α = 0 against DiLoCo
  (fp32 and int8 wires);
- ``end``: DiLoCo and Streaming DiLoCo (fp32 wire) end on the mean of the ranks' weights after the
  last step, also with an exchange in flight at the end;
- ``identical``: every run above and a streaming run with fragments, overlap and mixing (under the
  unified package's Trainer) end with bitwise-identical weights on every rank;
- ``resume``: 2 epochs straight (saving at the end of epoch 1) against epoch 2 resumed from that
  checkpoint, per rank, bitwise: DiLoCo mid-period with an SGD-momentum inner optimizer, and
  Streaming DiLoCo with an exchange in flight at the save and an Adam inner optimizer;
- ``fabric``: one Fabric run of each, ranks identical at the end.
"""
import hashlib
import importlib
import json
import os
import sys
import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B, LR = 4, 0.1


def digest(module):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


def identical(module):
    return len(set(COMM.allgather(digest(module)))) == 1


def trainer_run(strategy, steps_per_epoch=8, epochs=1, package="pytorch_lightning", inner="sgd",
                save_to=None, resume_from=None):
    """Train ``tiny_task``'s net; return (module, strategy)."""
    pl = importlib.import_module(package)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            if inner == "adam":
                return torch.optim.Adam(self.parameters(), lr=0.01)
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    class SaveAtEpochEnd(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if save_to is not None and trainer.current_epoch == 0:
                trainer.save_checkpoint(save_to)

    class MeanOfReplicas(pl.Callback):
        """After every step: the mean of the ranks' weights (collective), kept for the end's check."""

        def on_train_batch_end(self, trainer, pl_module, *args):
            weights = [p.detach().numpy() for p in pl_module.parameters()]
            REPLICAS_MEAN[:] = [torch.from_numpy(COMM.allreduce(w)) / W for w in weights]

    torch.manual_seed(100 + RANK)  # different initial weights: setup must broadcast rank 0's
    model = Module()
    trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[SaveAtEpochEnd(), MeanOfReplicas()], **QUIET)
    loader = DataLoader(dataset(W * B * steps_per_epoch), batch_size=B, shuffle=True)
    trainer.fit(model, loader, ckpt_path=resume_from)
    assert trainer.global_step == steps_per_epoch * epochs
    return model, trainer.strategy


#: the mean of the ranks' weights after the last step of the last run (MeanOfReplicas)
REPLICAS_MEAN = []


def from_replicas_mean(module):
    """How far ``module``'s weights are from the mean of the ranks' weights after the last step."""
    return max((p.detach() - m).abs().max().item() for p, m in zip(module.parameters(), REPLICAS_MEAN))


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def part_equivalences(results):
    S = lightning_mpi
    averaged, _ = trainer_run(S.ModelAveragingStrategy(period=3))
    plain, _ = trainer_run(S.DiLoCoStrategy(period=3, outer_lr=1.0, outer_momentum=0.0))
    results["model_avg"] = {"diff": max_diff(averaged, plain), "identical": identical(averaged) and identical(plain)}
    for wire in ("fp32", "int8"):
        # 8 steps, period 3: outer steps after steps 3 and 6, and the steps 7-8 folded in at the end
        diloco, strategy = trainer_run(S.DiLoCoStrategy(period=3, wire=wire))
        # the end averages the replicas (no outer step on a partial period): the mean of the ranks' weights
        # after step 8, to fp32 rounding on the fp32 wire
        end_diloco = from_replicas_mean(diloco)
        streaming, _ = trainer_run(S.StreamingDiLoCoStrategy(period=3, fragments=1, overlap_steps=0, mix_alpha=0.0, wire=wire))
        results[f"streaming_as_diloco_{wire}"] = {
            "diff": max_diff(diloco, streaming), "identical": identical(diloco) and identical(streaming),
            "outer_steps": strategy.bound_rule.stats()["outer_steps"],
            "moved": max_diff(diloco, plain),  # outer momentum makes a difference
            "end_from_mean": end_diloco, "end_from_mean_streaming": from_replicas_mean(streaming),
        }
    streaming, strategy = trainer_run(
        importlib.import_module("lightning_mpi.lightning").StreamingDiLoCoStrategy(period=4, fragments=2, overlap_steps=1),
        package="lightning.pytorch")
    stats = strategy.bound_rule.stats()
    results["streaming_overlapped"] = {"identical": identical(streaming), "outer_steps": stats["outer_steps"],
                                       "finite": all(bool(torch.isfinite(p).all()) for p in streaming.parameters())}
    # 7 steps, fragments exchanging after steps 3 and 6 with τ = 2: the end meets fragment 1's exchange
    # in flight (started after step 6) and step 7 not yet exchanged; it still ends on the replicas' mean
    streaming, _ = trainer_run(S.StreamingDiLoCoStrategy(period=6, fragments=2, overlap_steps=2, wire="fp32"),
                               steps_per_epoch=7)
    results["end_in_flight"] = {"end_from_mean": from_replicas_mean(streaming), "identical": identical(streaming)}


def part_resume(results):
    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    S = lightning_mpi
    # period 4, 6 steps per epoch: the save at step 6 is mid-period for DiLoCo; for streaming
    # (fragments exchange after steps 2, 6, 10 and 4, 8, 12) fragment 0's exchange started at
    # step 6 is in flight (τ = 1) at the save.
    cases = {
        "diloco": (lambda: S.DiLoCoStrategy(period=4, wire="int8"), "sgd"),
        "streaming": (lambda: S.StreamingDiLoCoStrategy(period=4, fragments=2, overlap_steps=1, wire="int4"), "adam"),
    }
    for name, (make, inner) in cases.items():
        path = os.path.join(directory, f"{name}.ckpt")
        straight, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner=inner, save_to=path)
        saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
        resumed, _ = trainer_run(make(), steps_per_epoch=6, epochs=2, inner=inner, resume_from=path)
        same = COMM.allgather(digest(straight) == digest(resumed))
        results[f"resume_{name}"] = {
            "equal_on_every_rank": all(same), "diff": max_diff(straight, resumed), "identical": identical(resumed),
            "saved_steps": saved["steps"], "in_flight_saved": [f["arrived"] is not None for f in saved["fragments"]],
            "ranks_saved": len(saved["ranks"]),
        }


def part_fabric(results):
    import lightning as L

    import lightning_mpi.fabric  # noqa: F401  (the classes built on lightning.fabric)

    for name, strategy in (("diloco", lightning_mpi.fabric.DiLoCoStrategy(period=3)),
                           ("streaming", lightning_mpi.fabric.StreamingDiLoCoStrategy(period=4, fragments=2))):
        fabric = L.Fabric(strategy=strategy, accelerator="cpu")
        fabric.launch()
        torch.manual_seed(100 + RANK)
        net = make_net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
        loader = fabric.setup_dataloaders(DataLoader(dataset(W * B * 10), batch_size=B, shuffle=True))
        for x, y in loader:
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        outer_steps = fabric.strategy.bound_rule.stats()["outer_steps"]
        fabric.strategy.finish_training()
        results[f"fabric_{name}"] = {"identical": identical(net), "outer_steps": outer_steps,
                                     "class": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__name__}


if __name__ == "__main__":
    results = {}
    part_equivalences(results)
    part_resume(results)
    part_fabric(results)
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
