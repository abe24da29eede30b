"""Train a small MLP on scikit-learn's digits (examples/digits_data.py) with each named strategy; rank 0 writes JSON.

Usage: rules_train.py OUT.json NAME[,NAME...] [SCENARIO]

SCENARIO "accuracy" (default): EPOCHS epochs per strategy; reports test accuracy of the final
weights, whether all ranks hold identical weights after fit, global steps, logged stats, and
whether background threads survived teardown. "single" trains with one process (strategy "auto").
SCENARIO "uneven": rank r runs 6 + 5r batches per epoch (different step counts).
SCENARIO "save": K = 12 steps with ``ModelCheckpoint(every_n_train_steps=K)`` into
$RULES_CKPT_DIR/NAME (written mid-training, before ``on_train_end``). SCENARIO "resume": a new
launch (any world size) fits to 2K steps from that checkpoint and records what the rule holds
right after its ``on_train_start`` (restored, not re-initialised?) and the warnings.
A NAME may be written "SCENARIO/NAME" to run it under another scenario in the same launch
(each launch costs 10-20 s of imports), and "NAME@key=value+key=value" to override the
strategy's arguments (``lr_mode=fixed|linear`` sets the learning-rate rule).
SCENARIO "turns": as "accuracy", but a parameter-server rule's commits (clock tick, read, add, pull)
take turns: every rank's k-th commit waits for rank r − 1's k-th, so the interleaving of commits,
hence the staleness each one sees and the center it reads, is the same in every run and the final
weights are bitwise reproducible (the free-running order depends on thread timing under load).
For the gossip rule, "turns" is lockstep: after every local step each rank pushes (same draws of
its seeded generator as free-running), then every rank receives exactly the pushes addressed to it
in that step, in order of source rank, and merges them; which peers mix when, and the order of
merges, are then the same in every run (free-running, a push is merged when its receiver next
finds it, which depends on the load).
SCENARIO "stop": a callback asks ``strategy.broadcast`` (rank 0 decides after its 4th batch, like
Timer) and ``reduce_boolean_decision`` (the last rank decides, like EarlyStopping) every batch;
every rank must stop well before max_epochs. Also saves and checks a checkpoint's rule state.
SCENARIO "timed": ``Trainer(max_time=...)`` with a validation every 5 batches that logs with
``sync_dist=True`` and a torchmetrics ``Accuracy``: every rank must stop having run the same
validations (a rank that stopped earlier would meet another's collective with its own), each at its
own pace between the same two validations.
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
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import torchmetrics  # noqa: E402

import lightning_mpi  # noqa: E402,F401
from examples.digits_data import held_out_split, load_digits  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
EPOCHS, BATCH = int(os.environ.get("RULES_EPOCHS", 8)), 32
LR = float(os.environ.get("RULES_LR", 0.1))
#: "linear" (default): Goyal et al.'s linear scaling rule with gradual warm-up: lr = LR·W, reached
#: linearly from LR over the first WARMUP_EPOCHS epochs (W ranks × batch B take W× fewer steps per
#: epoch than one process; a W× larger step keeps the distance travelled per epoch). "fixed": LR.
LR_MODE = os.environ.get("RULES_LR_MODE", "linear")
WARMUP_EPOCHS = float(os.environ.get("RULES_WARMUP_EPOCHS", 1))


def data():
    x, y = load_digits()
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = held_out_split(x, y)
    t = lambda a, d: torch.tensor(a, dtype=d)  # noqa: E731
    return TensorDataset(t(xtr, torch.float32), t(ytr, torch.long)), (t(xte, torch.float32), t(yte, torch.long))


def make_strategy(spec):
    """``NAME`` or ``NAME@key=value,...`` (``;``-separated in argv): a registered name with overrides."""
    if spec == "single":
        return "auto"
    if "@" not in spec:
        return spec
    import lightning_mpi
    from lightning_mpi import STRATEGIES

    name, _, rest = spec.partition("@")
    class_name, params, _ = STRATEGIES[name]
    cls = getattr(lightning_mpi, class_name)
    kwargs = dict(params)
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        if key != "lr_mode":
            kwargs[key] = float(value) if "." in value or "e" in value else int(value)
    return cls(**kwargs)


#: Rules that already take a larger step than plain SGD, so their lr is not scaled with W.
#: DOWNPOUR sums W workers' whole deltas (the center moves ~W× per epoch: "asynchrony begets
#: momentum", Mitliagkas et al. 2016); EAMSGD adds its own Nesterov momentum δ = 0.9 (effective
#: step lr / (1 − δ) = 10·lr). With lr·W both overshoot at W = 3 (DOWNPOUR 0.38, EAMSGD 0.64–0.92).
UNSCALED_LR = ("mpi_downpour", "mpi_eamsgd")
CKPT_DIR = os.environ.get("RULES_CKPT_DIR", "")
K = 12  # steps before the checkpoint in the "save" scenario


def lr_mode(spec):
    """The spec's ``lr_mode=``, else "fixed" for DOWNPOUR (it sums W workers' whole deltas, so it
    already moves the center ~W× per epoch: with lr·W it diverges at W = 3), else ``LR_MODE``."""
    for item in spec.partition("@")[2].split("+"):
        if item.startswith("lr_mode="):
            return item.split("=", 1)[1]
    return "fixed" if spec.partition("@")[0] in UNSCALED_LR else LR_MODE


class Net(pl.LightningModule):
    def __init__(self, mode="fixed"):
        super().__init__()
        self.mode = mode
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.validations = 0

    def validation_step(self, batch, _):
        x, y = batch
        out = self.net(x)
        self.accuracy(out, y)
        self.log("val_loss", nn.functional.cross_entropy(out, y), sync_dist=True)
        self.log("val_acc", self.accuracy)

    def on_validation_end(self):
        self.validations += 1

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        scale = W if self.mode == "linear" else 1
        opt = torch.optim.SGD(self.parameters(), lr=LR * scale)
        if scale == 1:
            return opt
        steps = self.trainer.estimated_stepping_batches / max(1, self.trainer.max_epochs or 1)
        warm = max(1, int(WARMUP_EPOCHS * steps))
        factor = lambda s: (1 + (scale - 1) * min(1.0, s / warm)) / scale  # noqa: E731  LR -> LR·W
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class StopVote(pl.Callback):
    """Rank 0 "times out" after its 4th batch (broadcast), the last rank "early-stops" after its 6th."""

    def __init__(self):
        self.calls = 0

    def on_train_batch_end(self, trainer, *args):
        self.calls += 1
        a = trainer.strategy.broadcast(RANK == 0 and self.calls >= 4)
        b = trainer.strategy.reduce_boolean_decision(RANK == W - 1 and self.calls >= 6, all=False)
        trainer.should_stop = trainer.should_stop or a or b


class Capture(pl.Callback):
    """For "resume": what the rule holds right after its ``on_train_start`` (which runs after the
    callbacks' ``on_train_start``): the whole center, clock, steps, momentum, gossip weight and θ."""

    def __init__(self):
        self.seen = {}

    def on_train_start(self, trainer, pl_module):
        bound = trainer.strategy.bound_rule
        original = bound.on_train_start
        self.seen["global_step_at_start"] = trainer.global_step

        def wrapped():
            original()
            seen = self.seen
            seen["restored"] = bool(getattr(bound, "restored", False))
            if getattr(bound, "center", None) is not None and hasattr(bound, "clock"):
                seen["center"] = bound.center.read(torch.empty_like(bound.ref))[: bound.numel].tolist()
                seen["clock"] = int(bound.clock.read()[0])
                seen["steps"] = bound.steps
                seen["momentum_norm"] = float(sum(b.double().norm() ** 2 for b in bound.momentum_bufs)) ** 0.5
            if hasattr(bound, "weight"):
                seen["weight"] = bound.weight
                seen["theta"] = bound.flat.pull()[: bound.flat.bucket.numel].tolist()

        bound.on_train_start = wrapped


class Turns(pl.Callback):
    """For "turns": wrap the bound server rule's ``commit`` so that rank 0 commits, then rank 1, ...,
    then rank W − 1 (a barrier on COMM_WORLD between turns), every ``period`` steps. Every rank
    runs the same number of steps here (same-sized shards), so every rank calls it equally often.

    ``together``: after the round, every rank pulls the center again (it then holds every rank's
    commit of the round): the round acts as one commit of the W deltas, with staleness r for rank
    r. For DOWNPOUR, which sums stale deltas as they are: with one pull per commit the turns are its
    worst case (every rank on a different center; 0.618 at W = 3), and free-running under load its
    accuracy is a draw of the thread timing (0.716 once at W = 3 with a busy core)."""

    def __init__(self, together=False):
        self.together = together

    def on_train_start(self, trainer, pl_module):
        bound = trainer.strategy.bound_rule
        original = bound.commit

        def commit():
            for turn in range(W):
                if turn == RANK:
                    original()
                COMM.Barrier()
            if self.together:  # every rank pulls the center holding the whole round's commits
                center, _ = bound.windows()
                bound.pull_(center.read(bound.scratch).clone())
                bound.clock_at_pull += W - 1 - RANK  # the commits after this rank's in the round

        bound.commit = commit
        self.bound = bound


class Lockstep(pl.Callback):
    """For "turns" with the gossip rule: replace the bound rule's ``_advance`` (merge what
    arrived, push with probability p, reap) by its lockstep form: push with probability p, then
    (one allreduce of who sent to whom) receive and merge exactly this step's pushes to this rank,
    in order of source rank. Every rank runs the same number of steps (same-sized shards)."""

    def on_train_start(self, trainer, pl_module):
        bound = trainer.strategy.bound_rule

        def advance():
            mailbox = bound.mailbox  # made by the rule's on_train_start, which runs after this one
            if bound.rng.random() < bound.rule.p:
                bound._push()
            sent = np.zeros((W, W), dtype=np.int64)
            sent[RANK] = mailbox.sent_to
            COMM.Allreduce(MPI.IN_PLACE, sent, op=MPI.SUM)
            for source in range(W):
                for _ in range(int(sent[source, RANK]) - mailbox.received_from[source]):
                    bound._merge(mailbox._receive_from(source))
            mailbox.reap()

        bound._advance = advance
        self.bound = bound


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
    model = Net(lr_mode(name))
    rec = Recorder()
    threads_before = threading.active_count()
    kwargs = dict(QUIET, max_epochs=EPOCHS, logger=[rec], log_every_n_steps=2, accelerator="cpu", limit_val_batches=0)
    callbacks = []
    if scenario == "uneven":
        kwargs.update(max_epochs=2, limit_train_batches=6 + 5 * RANK)
    turns = None
    if scenario == "turns":
        turns = Lockstep() if name == "mpi_gosgd" else Turns(together=name == "mpi_downpour")
    if turns is not None:
        callbacks.append(turns)
    if scenario == "stop":
        kwargs.update(max_epochs=50)
        callbacks.append(StopVote())
    val = None
    if scenario == "timed":
        kwargs.update(max_epochs=50, max_time="00:00:00:02", limit_val_batches=2, val_check_interval=5)
        val = DataLoader(TensorDataset(*test), batch_size=64)
    ckpt_path, capture = None, Capture()
    if scenario in ("save", "resume"):
        from pytorch_lightning.callbacks import ModelCheckpoint

        d = os.path.join(CKPT_DIR, name)
        kwargs.update(enable_checkpointing=True, max_epochs=-1, max_steps=K if scenario == "save" else 2 * K)
        callbacks += [ModelCheckpoint(dirpath=d, filename="k{step}", auto_insert_metric_name=False,
                                      every_n_train_steps=K, save_top_k=-1), capture]
        ckpt_path = os.path.join(d, f"k{K}.ckpt") if scenario == "resume" else None
    trainer = pl.Trainer(strategy="auto" if scenario == "single" else make_strategy(name), callbacks=callbacks, **kwargs)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(train, batch_size=BATCH, shuffle=True), val, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - start
    out = {"seconds": seconds, "global_step": trainer.global_step, "stat_keys": sorted(rec.keys),
           "warnings": [str(w.message) for w in caught if "lightning_mpi" in str(w.message)]}
    if isinstance(turns, Turns):  # each rank's commits, and the period the rule committed at
        out["commits"] = COMM.allgather(turns.bound.commits)
        out["period"] = turns.bound.rule.period
    if scenario == "resume":
        out["seen"] = COMM.allgather(capture.seen)
    bound = getattr(trainer.strategy, "bound_rule", None)
    if hasattr(bound, "received"):  # gossip: every push sent must have been merged by its peer
        out["gossip"] = {"pushes": COMM.allgather(bound.pushes), "received": COMM.allgather(bound.received)}
    if scenario == "stop":
        out["rule_state_keys"] = sorted(bound.state_dict()) if bound is not None else []
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        out["acc"] = float((model.net(test[0]).argmax(1) == test[1]).float().mean())
    if scenario != "single":
        all_flat = COMM.allgather(flat.numpy())
        out["max_rank_diff"] = float(max(np.abs(f - all_flat[0]).max() for f in all_flat))
        out["steps_per_rank"] = COMM.allgather(trainer.global_step)
        out["validations_per_rank"] = COMM.allgather(model.validations)
    time.sleep(0.05)
    out["leaked_threads"] = threading.active_count() - threads_before
    return out


def main():
    out_path, names = sys.argv[1], sys.argv[2].split(",")
    scenario = sys.argv[3] if len(sys.argv) > 3 else "accuracy"
    train, test = data()
    results = {}
    for name in names:  # "SCENARIO/NAME" runs NAME under another scenario in the same launch
        sc, _, bare = name.rpartition("/")
        results[name] = run(bare, sc or scenario, train, test)
    if RANK == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": W, "results": results}, f)


if __name__ == "__main__":
    main()
