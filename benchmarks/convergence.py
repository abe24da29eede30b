"""Convergence of every exchange rule on scikit-learn digits: accuracy against wall time.

    python benchmarks/convergence.py --ranks 2 --budget 15            # same wall-clock budget
    python benchmarks/convergence.py --ranks 2 --budget 15 --straggler
    python benchmarks/convergence.py --ranks 2 --epochs 8             # same number of epochs

Every rule, plus synchronous ``mpi_asa`` and one process, trains the same MLP (64-32-10, plain
SGD, batch 32 per rank) on digits (75/25 stratified split). Learning rate: Goyal et al.'s linear
scaling rule with gradual warm-up: ``lr = 0.1·W``, reached linearly from 0.1 over the first epoch
(one process: 0.1). DOWNPOUR and EAMSGD are the exceptions (``lr = 0.1``): DOWNPOUR adds every
worker's whole delta to the center, so W asynchronous workers already move the center about W×
per epoch ("asynchrony begets momentum", Mitliagkas et al. 2016), and EAMSGD adds its own
Nesterov momentum 0.9 (a 10× effective step); with ``0.1·W`` both overshoot at W = 3.

Modes:
- ``--budget S``: ``Trainer(max_time=S)`` (Lightning's own Timer: the asynchronous strategies must
  keep their speed with it). Reports samples processed (all ranks) and the test accuracy of the
  final weights (the center / consensus / averaged weights that ``fit`` leaves on every rank).
- ``--straggler``: the last rank sleeps 2× its measured step time after each step, so it runs 3×
  slower. Synchronous rules then run at the straggler's pace; asynchronous ones should not.
- ``--epochs E``: E epochs per rank (W ranks take W× fewer steps than one process).

The curve: rank 0 evaluates its current weights on the test set every ``--every`` seconds
(rank 0's local weights: the pulled center for parameter-server rules, a worker for elastic and
gossip rules), plus the final point. Results: a table on stdout, JSON and a PNG under
``benchmarks/results/`` (git-ignored). The timings depend on the machine's load: say what else
ran when quoting them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RULES = ["mpi_asa", "mpi_easgd", "mpi_model_avg", "mpi_aeasgd", "mpi_eamsgd", "mpi_downpour", "mpi_agn",
         "mpi_adag", "mpi_dynsgd", "mpi_gosgd"]
ASYNC = {"mpi_aeasgd", "mpi_eamsgd", "mpi_downpour", "mpi_agn", "mpi_adag", "mpi_dynsgd", "mpi_gosgd"}
#: rules whose learning rate is not scaled with W (see the module docstring)
UNSCALED_LR = {"mpi_downpour", "mpi_eamsgd"}
BASE_LR, BATCH = 0.1, 32


# -- worker (runs under mpiexec) ---------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mpi  # noqa: F401
    from examples.digits_data import held_out_split, load_digits

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    x, y = load_digits()
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = held_out_split(x, y)
    train = TensorDataset(torch.tensor(xtr), torch.tensor(ytr, dtype=torch.long))
    xte, yte = torch.tensor(xte), torch.tensor(yte, dtype=torch.long)
    steps_per_epoch = math.ceil(math.ceil(len(train) / world) / BATCH)

    class Net(pl.LightningModule):
        def __init__(self, scale: int) -> None:
            super().__init__()
            self.scale = scale
            self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

        def training_step(self, batch, _):
            xb, yb = batch
            return nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=BASE_LR * self.scale)
            if self.scale == 1:
                return opt
            s, warm = self.scale, steps_per_epoch
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (1 + (s - 1) * min(1.0, t / warm)) / s)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def accuracy(model) -> float:
        with torch.no_grad():
            return float((model.net(xte).argmax(1) == yte).float().mean())

    class Probe(pl.Callback):
        """Counts samples; on rank 0 records (seconds, accuracy); the straggler sleeps."""

        def __init__(self, straggle: bool) -> None:
            self.samples, self.curve, self.straggle, self.t0, self.next = 0, [], straggle, 0.0, 0.0

        def on_train_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.tb = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.samples += len(batch[0])
            if self.straggle:
                time.sleep(2.0 * (now - self.tb))
            if rank == 0 and now - self.t0 >= self.next:
                self.curve.append((now - self.t0, accuracy(pl_module)))
                self.next += args.every

    out = {}
    names = args.names.split(",")
    for name in names:
        torch.manual_seed(0)
        scale = 1 if (world == 1 or name in UNSCALED_LR) else world
        model = Net(scale)
        probe = Probe(args.straggler and rank == world - 1 and world > 1)
        kw = dict(max_epochs=args.epochs) if args.epochs else dict(max_epochs=10_000, max_time={"seconds": args.budget})
        trainer = pl.Trainer(strategy="auto" if world == 1 else name, callbacks=[probe], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", limit_val_batches=0, **kw)
        comm.Barrier()
        start = time.perf_counter()
        trainer.fit(model, DataLoader(train, batch_size=BATCH, shuffle=True))
        seconds = time.perf_counter() - start
        acc = accuracy(model)
        samples = comm.allreduce(probe.samples)
        steps = comm.gather(trainer.global_step, root=0)
        if rank == 0:
            curve = probe.curve + [(seconds, acc)]
            out["single" if world == 1 else name] = {"acc": acc, "samples": samples, "seconds": seconds,
                                                      "steps_per_rank": steps, "lr_scale": scale, "curve": curve}
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))


# -- driver -------------------------------------------------------------------------------------------
def launch(world: int, names: list[str], args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--names", ",".join(names), "--out", str(out),
           "--budget", str(args.budget), "--epochs", str(args.epochs), "--every", str(args.every)]
    if args.straggler:
        cmd.append("--straggler")
    if world > 1:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(world), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH", "")])))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--budget", type=float, default=15.0, help="wall-clock seconds per run")
    p.add_argument("--epochs", type=int, default=0, help="train this many epochs instead of a time budget")
    p.add_argument("--straggler", action="store_true", help="the last rank runs 3x slower")
    p.add_argument("--every", type=float, default=1.0, help="seconds between accuracy probes on rank 0")
    p.add_argument("--names", default=",".join(RULES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    mode = f"epochs{args.epochs}" if args.epochs else f"budget{args.budget:g}s" + ("_straggler" if args.straggler else "")
    tag = f"convergence_{mode}_w{'-'.join(map(str, args.ranks))}"
    names = args.names.split(",")
    single = launch(1, ["single"], args, RESULTS / f"{tag}_single.json")["single"]
    table = {"single": {1: single}}
    for w in args.ranks:
        res = launch(w, names, args, RESULTS / f"{tag}_w{w}.json")
        for name, r in res.items():
            table.setdefault(name, {})[w] = r
    (RESULTS / f"{tag}.json").write_text(json.dumps({"args": vars(args), "results": table}))
    ref = {w: table["mpi_asa"][w]["samples"] for w in args.ranks if w in table.get("mpi_asa", {})}
    print(f"# {mode}; single process: acc {single['acc']:.3f}, {single['samples']} samples, {single['seconds']:.1f} s")
    print("| rule | W | lr | test acc | Δ vs single (pts) | samples | samples / mpi_asa | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for w in args.ranks:
            r = table.get(name, {}).get(w)
            if r is None:
                continue
            ratio = r["samples"] / ref[w] if w in ref else float("nan")
            print(f"| {name} | {w} | {0.1 * r['lr_scale']:.1f} | {r['acc']:.3f} | {100 * (r['acc'] - single['acc']):+.1f} "
                  f"| {r['samples']} | {ratio:.2f} | {r['seconds']:.1f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(args.ranks), figsize=(7 * len(args.ranks), 5), squeeze=False)
    for ax, w in zip(axes[0], args.ranks):
        c = single["curve"]
        ax.plot([t for t, _ in c], [a for _, a in c], "k-", lw=2, label="single process")
        for name in names:
            r = table.get(name, {}).get(w)
            if r:
                c = r["curve"]
                ax.plot([t for t, _ in c], [a for _, a in c], "--" if name in ASYNC else "-", label=name)
        ax.set(title=f"digits, W={w}, {mode}", xlabel="wall time (s)", ylabel="test accuracy", ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{tag}.png", dpi=100)
    print(f"plot: {RESULTS / f'{tag}.png'}")


if __name__ == "__main__":
    main()
