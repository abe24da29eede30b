"""Run on W ranks: one rank fails inside fit, every rank catches, and a second fit trains.

``python rank_failures.py OUT.json MODE [ARGS]`` (rank 0 writes OUT.json):

- ``cases STRATEGY/PHASE,... [N]``: for each case, the last rank raises in PHASE of a Trainer fit;
  every rank catches what fit raised (``try: trainer.fit(...) except Exception``). Recorded per
  rank: the exception's type, message and ``rank`` attribute, and the seconds from the failing
  rank's raise to this rank's catch. Then a second fit (a new Trainer and strategy) trains 4 steps,
  and every rank's final weights are recorded (they must be identical). Phases: ``setup``
  (``LightningModule.setup``), ``step`` (``training_step``), ``validation`` (``validation_step``),
  ``checkpoint`` (``on_save_checkpoint`` during ``trainer.save_checkpoint``), ``loader`` (the
  dataset), ``thread`` (the rule's progress thread: the synchronous rules' driver, the parameter
  server's ``Iprobe`` thread). ``fabric:STRATEGY/loop``: the same with ``lightning_fabric.Fabric``:
  the last rank raises in its own training loop, inside ``fabric.strategy.propagate_errors()``.
- then, with ``N``, the leak check (OUT.json holds ``{"cases": ..., "leak": ...}``):
  N failed-and-retried fits (each a ``step`` failure and a successful fit), alternating
  ``mpi_downpour`` and ``mpi_asa16``, each with a new Trainer and a new strategy; threads, open files,
  RSS and the communicators and windows lightning_mpi made are sampled after the 2nd and the last.
- ``unhandled STRATEGY``: the last rank raises in ``training_step`` and nobody catches it; it prints
  ``failed at <unix time>`` first (the test measures how long the job takes to end from there).
"""
import gc
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from lightning_mpi import STRATEGIES  # noqa: E402
from lightning_mpi.comm.resources import live_handles  # noqa: E402
from tiny_task import make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
FAILING = W - 1
PLAN = {"phase": None}  # what to inject in the current fit
RAISED_AT = {"time": None}


class Injected(RuntimeError):
    """The failure this script injects."""


def fail(where):
    RAISED_AT["time"] = time.time()
    raise Injected(f"injected failure in {where} on rank {RANK}")


def injecting(phase):
    return PLAN["phase"] == phase and RANK == FAILING


class Data(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 10, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long()
        self.fetched = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.fetched += 1
        if injecting("loader") and self.fetched == 9:  # the third batch of 4
            fail("the data loader")
        return self.x[i], self.y[i]


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(100 + RANK)  # ranks start apart: fit must broadcast rank 0's weights
        self.net = make_net()

    def setup(self, stage):
        if injecting("setup"):
            fail("LightningModule.setup")

    def training_step(self, batch, i):
        if injecting("step") and i == 2:
            fail("training_step")
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, i):
        if injecting("validation"):
            fail("validation_step")
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def on_save_checkpoint(self, checkpoint):
        if injecting("checkpoint"):
            fail("on_save_checkpoint")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Injector(pl.Callback):
    """``checkpoint``: save at step 2; ``thread``: break the rule's progress thread at step 2."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        if trainer.global_step == 2 and PLAN["phase"] == "checkpoint":
            trainer.save_checkpoint(Path(self.folder) / "at2.ckpt")

    def on_train_batch_start(self, trainer, module, batch, i):
        if i != 2 or not injecting("thread"):
            return
        bound = trainer.strategy.bound_rule
        thread = getattr(bound, "progress", None) or bound.exchanger.driver  # parameter server, or sync

        def broken_poll():
            fail("a progress thread")

        thread._poll = broken_poll
        thread.start()  # the synchronous driver runs while exchanges are in flight: make sure it runs


def make_strategy(name):
    class_name, params, _ = STRATEGIES[name]
    return getattr(lightning_mpi, class_name)(**params, collective_timeout=60.0)


def trainer_for(strategy, steps, folder, callbacks=()):
    return pl.Trainer(
        strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0,
        default_root_dir=folder, callbacks=list(callbacks),
    )


def loaders():
    return DataLoader(Data(16 * W), batch_size=4), DataLoader(Data(8 * W), batch_size=4)


def failed_fit(strategy, phase, folder):
    """One fit with ``phase`` injected on the failing rank; what this rank caught, and when."""
    PLAN["phase"], RAISED_AT["time"] = phase, None
    trainer = trainer_for(strategy, 8, folder, [Injector(folder)])
    try:
        trainer.fit(Module(), *loaders())
    except Exception as error:  # noqa: BLE001  the point of the test
        caught_at = time.time()
        return {"type": type(error).__name__, "message": str(error), "rank": getattr(error, "rank", None),
                "raised_at": RAISED_AT["time"], "caught_at": caught_at}
    finally:
        PLAN["phase"] = None
    return {"type": None, "message": "fit returned", "rank": None, "raised_at": RAISED_AT["time"], "caught_at": time.time()}


def good_fit(strategy, folder):
    module = Module()
    trainer = trainer_for(strategy, 4, folder)
    trainer.fit(module, *loaders())
    return {"global_step": trainer.global_step,
            "weights": torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()}


def fabric_fit(name, inject):
    """A Fabric loop of 4 steps (``inject``: the failing rank raises at step 2); the module."""
    import lightning_fabric as lf

    import lightning_mpi.lightning_fabric as classes

    class_name, params, _ = STRATEGIES[name]
    fabric = lf.Fabric(strategy=getattr(classes, class_name)(**params, collective_timeout=60.0), accelerator="cpu")
    fabric.launch()
    torch.manual_seed(100 + RANK)
    net = make_net()
    data = Data(16)
    with fabric.strategy.propagate_errors():
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in range(4):
            if inject and RANK == FAILING and step == 2:
                fail("the Fabric loop")
            x, y = data.x[4 * step : 4 * step + 4], data.y[4 * step : 4 * step + 4]
            fabric.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        fabric.strategy.finish_training()
    return net


def failed_fabric_fit(name):
    RAISED_AT["time"] = None
    try:
        fabric_fit(name, inject=True)
    except Exception as error:  # noqa: BLE001  the point of the test
        return {"type": type(error).__name__, "message": str(error), "rank": getattr(error, "rank", None),
                "raised_at": RAISED_AT["time"], "caught_at": time.time()}
    return {"type": None, "message": "the loop ended", "rank": None, "raised_at": None, "caught_at": time.time()}


def good_fabric_fit(name):
    net = fabric_fit(name, inject=False)
    return {"global_step": 4, "weights": torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()}


def run_cases(specs, folder):
    results = {}
    for spec in specs:
        name, phase = spec.split("/")
        start = time.time()
        if name.startswith("fabric:"):
            caught, again = failed_fabric_fit(name[7:]), good_fabric_fit(name[7:])
        else:
            caught = failed_fit(make_strategy(name), phase, folder)
            again = good_fit(make_strategy(name), folder)
        everyone = COMM.allgather({"caught": caught, **again, "seconds": time.time() - start})
        raised = [r["caught"]["raised_at"] for r in everyone if r["caught"]["raised_at"] is not None]
        for r in everyone:
            r["caught"]["delay"] = r["caught"]["caught_at"] - raised[0] if raised else None
        results[spec] = everyone
    return results


def sample():
    gc.collect()
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "rss_kib": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024,
            **live_handles()}


def run_leak(rounds, folder):
    samples = []
    for k in range(rounds):
        name = ("mpi_downpour", "mpi_asa16")[k % 2]
        caught = failed_fit(make_strategy(name), "step", folder)
        assert caught["type"] in ("Injected", "RankFailedError"), caught
        good_fit(make_strategy(name), folder)
        if k in (1, rounds - 1):
            samples.append(sample())
    return COMM.allgather(samples)


def run_unhandled(name, folder):
    PLAN["phase"] = "step"
    original = Module.training_step

    def announced(self, batch, i):
        if injecting("step") and i == 2:
            print(f"failed at {time.time():.3f}", flush=True)
        return original(self, batch, i)

    Module.training_step = announced
    trainer_for(make_strategy(name), 8, folder).fit(Module(), *loaders())
    print(f"rank {RANK} finished normally", flush=True)


if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as scratch:
        folder = COMM.bcast(scratch if RANK == 0 else None)
        if mode == "unhandled":
            run_unhandled(sys.argv[3], folder)
            sys.exit(0)
        result = {"cases": run_cases(sys.argv[3].split(","), folder)}
        if len(sys.argv) > 4:
            result["leak"] = run_leak(int(sys.argv[4]), folder)
        COMM.Barrier()
    if RANK == 0:
        out.write_text(json.dumps(result))
