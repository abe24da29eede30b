"""Run on W ranks with a fault injected by argv[1]; the test checks how the job ends.

Modes: step (rank 1 raises in training_step), loader (rank 1's dataset raises), callback
(the last rank's callback raises), sigkill (rank 1 kills itself), stuck (rank 1 sleeps in
training_step while the others wait; collective_timeout=4), model (rank 1 builds another model).

Asynchronous worker death, argv: MODE DIR STRATEGY (a parameter-server strategy name):
async_dies: at global step 10 every rank saves DIR/k10.ckpt; right before, with every rank held in
barriers (no commit can land), rank 0 reads the center and the clock into DIR/snapshot.pt. Rank 1
goes on committing and raises in training_step at step 16, after writing the center it saw then
to DIR/at_death.pt; nobody catches it, so sys.excepthook's abort must end the job. async_resume: a new launch resumes from
DIR/k10.ckpt to 24 steps and writes what the rule held right after restoring, and the final
weights of every rank, to DIR/resume.json.
"""
import json
import os
import signal
import sys
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

MODE = sys.argv[1]
RANK, W = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


class Data(Dataset):
    def __len__(self):
        return 64 * W

    def __getitem__(self, i):
        if MODE == "loader" and RANK == 1 and i % W == 1 and torch.rand(1).item() < 2:  # noqa: PLR2004
            raise KeyError(f"corrupt sample {i} on rank {RANK}")
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randint(0, 2, (1,), generator=g).squeeze()


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        width = 17 if (MODE == "model" and RANK == 1) else 16
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))

    def training_step(self, batch, i):
        if i == 3 and RANK == 1:
            if MODE == "step":
                raise RuntimeError(f"boom in training_step on rank {RANK}")
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "stuck":
                time.sleep(600)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Failing(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if MODE == "callback" and trainer.global_step == 2 and RANK == W - 1:
            raise ValueError(f"callback failed on rank {RANK}")


class Snapshot(pl.Callback):
    """async_dies: at step 10, snapshot the center with every rank held in barriers, then save."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step != 10:
            return
        bound = trainer.strategy.bound_rule
        MPI.COMM_WORLD.Barrier()  # every rank is here: its commits so far have landed, none is in flight
        if RANK == 0:
            center = bound.center.read(torch.empty_like(bound.ref))[: bound.numel].clone()
            torch.save({"center": center, "clock": int(bound.clock.read()[0]), "commits": bound.commits}, self.out / "snapshot.pt")
        MPI.COMM_WORLD.Barrier()  # nobody commits before rank 0 has read
        trainer.save_checkpoint(self.out / "k10.ckpt")


class DyingWorker(Module):
    """async_dies: rank 1 records the center it sees, then raises at step 16 (after more commits)."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def training_step(self, batch, i):
        if RANK == 1 and self.trainer.global_step == 16:
            bound = self.trainer.strategy.bound_rule
            center = bound.center.read(torch.empty_like(bound.ref))[: bound.numel].clone()
            torch.save({"center": center, "commits": bound.commits}, self.out / "at_death.pt")
            raise RuntimeError(f"worker died on rank {RANK} after {bound.commits} commits")
        return super().training_step(batch, i)


class SeeRestore(pl.Callback):
    """async_resume: what the rule holds right after its on_train_start restored the checkpoint."""

    def __init__(self):
        self.seen = {}

    def on_train_start(self, trainer, pl_module):  # callbacks run before the strategy's hook: wrap it
        bound = trainer.strategy.bound_rule
        original = bound.on_train_start

        def wrapped():
            original()
            MPI.COMM_WORLD.Barrier()  # nobody trains (commits) before every rank has read
            self.seen = {"restored": bool(bound.restored), "clock": int(bound.clock.read()[0]),
                         "center": bound.center.read(torch.empty_like(bound.ref))[: bound.numel].tolist(),
                         "global_step": trainer.global_step}
            MPI.COMM_WORLD.Barrier()

        bound.on_train_start = wrapped


def run_async(mode, out, strategy):
    """The asynchronous worker-death scenario (see the module docstring)."""
    see = SeeRestore()
    resume = mode == "async_resume"
    trainer = pl.Trainer(
        strategy=strategy,
        max_steps=24 if resume else 40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[see] if resume else [Snapshot(out)],
    )
    model = Module() if resume else DyingWorker(out)
    trainer.fit(model, DataLoader(Data(), batch_size=4), ckpt_path=str(out / "k10.ckpt") if resume else None)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = MPI.COMM_WORLD.gather({**see.seen, "weights": weights.tolist(), "final_step": trainer.global_step})
    if RANK == 0 and resume:
        (out / "resume.json").write_text(json.dumps(everyone))
    print(f"rank {RANK} finished normally", flush=True)


if MODE.startswith("async_"):
    run_async(MODE, Path(sys.argv[2]), sys.argv[3])
    sys.exit(0)

trainer = pl.Trainer(
    strategy=lightning_mpi.SyncStrategy(exchange="asa", collective_timeout=4.0),
    max_epochs=3,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[Failing()],
)
trainer.fit(Module(), DataLoader(Data(), batch_size=4))
print(f"rank {RANK} finished normally", flush=True)
