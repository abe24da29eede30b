"""Train a small MLP on scikit-learn digits with each named strategy; rank 0 writes JSON.

Usage: rules_train.py OUT.json NAME[,NAME...] [SCENARIO]

SCENARIO "accuracy" (default): EPOCHS epochs per strategy; reports test accuracy of the final
weights, whether all ranks hold identical weights after fit, global steps, logged stats, and
whether background threads survived teardown. "single" trains with one process (strategy "auto").
SCENARIO "uneven": rank r runs 6 + 5r batches per epoch (different step counts).
SCENARIO "stop": a callback asks ``strategy.broadcast`` (rank 0 decides after its 4th batch, like
Timer) and ``reduce_boolean_decision`` (the last rank decides, like EarlyStopping) every batch;
every rank must stop well before max_epochs. Also saves and checks a checkpoint's rule state.
"""
import json
import os
import sys
import threading
import time
import warnings

warnings.filterwarnings("ignore")
import numpy as np  # noqa: E402
import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_mpi  # noqa: E402,F401

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
EPOCHS, BATCH = int(os.environ.get("RULES_EPOCHS", 8)), 32
LR = float(os.environ.get("RULES_LR", 0.1))


def data():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    t = lambda a, d: torch.tensor(a, dtype=d)  # noqa: E731
    return TensorDataset(t(xtr, torch.float32), t(ytr, torch.long)), (t(xte, torch.float32), t(yte, torch.long))


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class StopVote(pl.Callback):
    """Rank 0 "times out" after its 4th batch (broadcast), the last rank "early-stops" after its 6th."""

    def __init__(self):
        self.calls = 0

    def on_train_batch_end(self, trainer, *args):
        self.calls += 1
        a = trainer.strategy.broadcast(RANK == 0 and self.calls >= 4)
        b = trainer.strategy.reduce_boolean_decision(RANK == W - 1 and self.calls >= 6, all=False)
        trainer.should_stop = trainer.should_stop or a or b


class Recorder(pl.loggers.logger.Logger):
    def __init__(self):
        super().__init__()
        self.keys = set()

    name = "rec"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.keys.update(metrics)

    def log_hyperparams(self, *a, **k):
        pass


def run(name, scenario, train, test):
    torch.manual_seed(100 + RANK)  # different init per rank: setup must broadcast rank 0's
    model = Net()
    rec = Recorder()
    threads_before = threading.active_count()
    kwargs = dict(max_epochs=EPOCHS, logger=[rec], log_every_n_steps=2, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    callbacks = []
    if scenario == "uneven":
        kwargs.update(max_epochs=2, limit_train_batches=6 + 5 * RANK)
    if scenario == "stop":
        kwargs.update(max_epochs=50)
        callbacks.append(StopVote())
    trainer = pl.Trainer(strategy="auto" if scenario == "single" else name, callbacks=callbacks, **kwargs)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(train, batch_size=BATCH, shuffle=True))
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "global_step": trainer.global_step, "stat_keys": sorted(rec.keys)}
    if scenario == "stop":
        bound = trainer.strategy.bound_rule
        out["rule_state_keys"] = sorted(bound.state_dict()) if bound is not None else []
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        out["acc"] = float((model.net(test[0]).argmax(1) == test[1]).float().mean())
    if scenario != "single":
        all_flat = COMM.allgather(flat.numpy())
        out["max_rank_diff"] = float(max(np.abs(f - all_flat[0]).max() for f in all_flat))
        out["steps_per_rank"] = COMM.allgather(trainer.global_step)
    time.sleep(0.05)
    out["leaked_threads"] = threading.active_count() - threads_before
    return out


def main():
    out_path, names = sys.argv[1], sys.argv[2].split(",")
    scenario = sys.argv[3] if len(sys.argv) > 3 else "accuracy"
    train, test = data()
    results = {name: run(name, scenario, train, test) for name in names}
    if RANK == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": W, "results": results}, f)


if __name__ == "__main__":
    main()
