"""Run on W ranks: ``mpi_auto`` and ``period="auto"`` through the Trainer (rank 0 writes argv[1]);
with argv[2] = ``levels``, on 4 ranks: ``mpi_auto`` per level (:func:`levels`).

- ``switches``: ``mpi_auto`` with assumed measurements that force streaming (the defaults) -> sync -> streaming ->
  sync (decisions after steps 5, 9 and 13: ``auto_assumed`` patches the rule's measurement in this process);
  after every step, whether every rank holds the same weights, and the arm in use (the same on every rank);
- ``resume``: 2 epochs of 10 steps straight (saving after step 10, while Streaming DiLoCo runs)
  against epoch 2 resumed from that checkpoint, per rank, bitwise; the resumed run switches back
  to sync at step 13 as the straight one does;
- ``measured``: ``mpi_auto`` with real measurements (it trains, the ranks agree, it logs), with the
  last rank 0.5 s late into step 5, whose end measures the link: the others wait for it in the
  probe, and every rank must still join the same collectives (issue 25: a rank that timed its
  own wait there took another number of Allreduces, and the job hung);
- ``diloco_auto``: ``DiLoCoStrategy(period="auto")`` straight against resumed, bitwise (the
  resumed run keeps the period the checkpoint holds).
"""
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402
from auto_assumed import assumed  # noqa: E402  (beside this script)
from tiny_task import dataset, make_net  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
B = 4
FAST, SLOW = "50,10000,0.05", "50,0.1,20"


def digest(module):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


class Module(pl.LightningModule):
    def __init__(self, late_at=None):
        super().__init__()
        self.net = make_net()
        self.late_at = late_at  # the step (1-based) into which the last rank comes 0.5 s late

    def training_step(self, batch, batch_idx):
        if RANK == W - 1 and self.late_at is not None and batch_idx == self.late_at - 1:
            time.sleep(0.5)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Watch(pl.Callback):
    """After every step: the arm in use and whether every rank holds the same weights (collective)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        bound = trainer.strategy.bound_rule
        arm = bound.choice.arm if hasattr(bound, "choice") else "-"
        seen = COMM.allgather((arm, digest(pl_module)))
        self.steps.append({"arm": arm, "arms_agree": len({a for a, _ in seen}) == 1,
                           "identical": len({d for _, d in seen}) == 1,
                           # hosts of two launch ranks (levels): each host's ranks hold the same weights
                           "identical_in_hosts": all(seen[r][1] == seen[r ^ 1][1] for r in range(W - W % 2))})


def run(strategy, steps_per_epoch=16, epochs=1, save_to=None, resume_from=None, late_at=None):
    class SaveAtEpochEnd(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if save_to is not None and trainer.current_epoch == 0:
                trainer.save_checkpoint(save_to)

    torch.manual_seed(100 + RANK)  # different initial weights: setup must broadcast rank 0's
    model, watch = Module(late_at), Watch()
    trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[SaveAtEpochEnd(), watch], **QUIET)
    loader = DataLoader(dataset(W * B * steps_per_epoch), batch_size=B, shuffle=True)
    trainer.fit(model, loader, ckpt_path=resume_from)
    return model, trainer.strategy, watch.steps


def main(out):
    results = {}
    forced = f"{FAST};{SLOW};{FAST}"
    with assumed(forced):
        model, strategy, steps = run(lightning_mpi.AutoStrategy(measure_every=4))
    stats = strategy.bound_rule.stats()
    results["switches"] = {"steps": steps, "switches": stats["switches"], "decisions": stats["decisions"],
                           "identical_end": len(set(COMM.allgather(digest(model)))) == 1}

    directory = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    cases = {
        "auto": lambda: lightning_mpi.AutoStrategy(measure_every=4),
        "diloco_auto": lambda: lightning_mpi.DiLoCoStrategy(period="auto", wire="int8"),
    }
    for name, make in cases.items():
        path = os.path.join(directory, f"{name}.ckpt")
        with assumed(forced) if name == "auto" else contextlib.nullcontext():
            straight, _, _ = run(make(), steps_per_epoch=10, epochs=2, save_to=path)
            saved = torch.load(path, weights_only=False)["lightning_mpi"]["state"]
            resumed, strategy, steps = run(make(), steps_per_epoch=10, epochs=2, resume_from=path)
        same = COMM.allgather(digest(straight) == digest(resumed))
        results[f"resume_{name}"] = {
            "equal_on_every_rank": all(same), "identical": len(set(COMM.allgather(digest(resumed)))) == 1,
            "saved": saved.get("choice") or saved.get("schedule"), "arms_after": [s["arm"] for s in steps],
            "stats": {k: v for k, v in strategy.bound_rule.stats().items() if k in ("switches", "period", "arm")},
        }

    # collective_timeout: a mismatch fails in 60 s instead of hanging for the default 30 min
    model, strategy, steps = run(lightning_mpi.AutoStrategy(measure_every=6, collective_timeout=60),
                                 steps_per_epoch=12, late_at=5)
    stats = strategy.bound_rule.stats()
    results["measured"] = {"arms_agree": all(s["arms_agree"] for s in steps), "arm": stats["arm"],
                           "identical_end": len(set(COMM.allgather(digest(model)))) == 1,
                           "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                           "has_link": stats.get("link_bandwidth", 0.0) > 0, "decisions": stats["decisions"]}
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def levels(out):
    """4 ranks as 2 hosts of 2: forced fast, slow, fast: every step over all ranks, two levels (every
    step inside each host, Streaming DiLoCo across), every step again."""
    os.environ["LIGHTNING_MPI_RANKS_PER_NODE"] = "2"  # fake hosts of 2 launch ranks
    with assumed(f"{FAST};{SLOW};{FAST}"):
        model, strategy, steps = run(lightning_mpi.AutoStrategy(measure_every=6), steps_per_epoch=20)
    stats = strategy.bound_rule.stats()
    result = {"steps": steps, "switches": stats["switches"],
              "identical_end": len(set(COMM.allgather(digest(model)))) == 1}
    if RANK == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    levels(sys.argv[1]) if sys.argv[2:] == ["levels"] else main(sys.argv[1])
