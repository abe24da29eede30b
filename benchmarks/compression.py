#!/usr/bin/env python3
"""Compressed exchange: bytes on the wire, samples/s on 2 simulated hosts at 1 Gbit/s, accuracy.

    python benchmarks/compression.py                 # everything (root needed for the hosts)
    python benchmarks/compression.py --skip-speed    # accuracy and bytes only

1. Accuracy and bytes: sklearn's ``digits`` (real 8x8 handwritten digits, 1,797 images, 25% held
   out), an MLP, 2 ranks on this machine, every codec with and without error feedback, against
   fp32 ``mpi_asa``. Bytes per step come from the rule's ``stats()``.
2. Samples/s: a 6.3M-parameter MLP on random data, 2 simulated hosts (``SimCluster``) joined by
   1 Gbit/s links, one rank each, against Lightning ``ddp`` (gloo; ``devices=1, num_nodes=2`` and
   ``MASTER_ADDR``/``NODE_RANK`` from MPI set by hand).

Prints tables; writes ``benchmarks/results/compression.json`` and ``compression.png``. Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

ACC_ROWS = [
    ("mpi_asa (fp32)", "mpi_asa", {}),
    ("int8 + EF", "compressed", {"codec": "int8"}),
    ("int8, no EF", "compressed", {"codec": "int8", "error_feedback": False}),
    ("topk 1% + EF", "compressed", {"codec": "topk", "ratio": 0.01}),
    ("topk 1%, no EF", "compressed", {"codec": "topk", "ratio": 0.01, "error_feedback": False}),
    ("topk 1% + EF + DGC mc + warm-up", "compressed",
     {"codec": "topk", "ratio": 0.01, "momentum_correction": True, "momentum": 0.9, "ratio_warmup_steps": 200}),
    ("onebit + EF", "compressed", {"codec": "onebit"}),
    ("onebit, no EF", "compressed", {"codec": "onebit", "error_feedback": False}),
]
SPEED_ROWS = [
    ("ddp (Lightning, gloo)", "ddp", {}),
    ("mpi_asa (fp32)", "mpi_asa", {}),
    ("int8 + EF", "compressed", {"codec": "int8"}),
    ("topk 1% + EF", "compressed", {"codec": "topk", "ratio": 0.01}),
    ("onebit + EF", "compressed", {"codec": "onebit"}),
]


# ------------------------------------------------------------------------------------- worker ---
def _strategy(kind: str, params: dict):
    if kind == "compressed":
        from lightning_mpi.compressed_strategies import CompressedSyncStrategy

        return CompressedSyncStrategy(**params)
    return kind


def worker(mode: str, rows: list, out: str, epochs: int, steps: int) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mpi  # noqa: F401

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    results = {}

    class MLP(pl.LightningModule):
        def __init__(self, sizes, lr, momentum):
            super().__init__()
            layers = []
            for a, b in zip(sizes[:-1], sizes[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])
            self.lr, self.momentum = lr, momentum

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    class Timer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_end(self, trainer, *args):
            self.times.append(time.perf_counter())

    class Bytes(pl.Callback):
        def __init__(self):
            self.wire, self.dense = [], []

        def on_train_batch_end(self, trainer, *args):
            bound = getattr(trainer.strategy, "bound_rule", None)
            if bound is not None:
                s = bound.stats()
                self.wire.append(s.get("wire_bytes", 0.0))
                self.dense.append(s.get("dense_bytes", s.get("wire_bytes", 0.0)))

    if mode == "acc":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)
        train = TensorDataset(torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr))
        xte, yte = torch.tensor(xte, dtype=torch.float32), torch.tensor(yte)
    for label, kind, params in rows:
        torch.manual_seed(0)
        if mode == "acc":
            momentum = 0.0 if params.get("momentum_correction") else 0.9
            model = MLP([64, 512, 512, 10], lr=0.05, momentum=momentum)
            loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
            kw = dict(max_epochs=epochs)
        else:
            model = MLP([1024, 2048, 2048, 10], lr=0.01, momentum=0.9)
            n = 32 * (steps + 1) * world
            data = TensorDataset(torch.randn(n, 1024), torch.randint(0, 10, (n,)))
            loader = DataLoader(data, batch_size=32)
            kw = dict(max_steps=steps)
        extra = {}
        if kind == "ddp":
            import socket as _s

            host = comm.bcast(_s.gethostbyname(_s.gethostname()) if rank == 0 else None)
            os.environ.update(MASTER_ADDR=host, MASTER_PORT="29555", WORLD_SIZE=str(world), NODE_RANK=str(rank),
                              LOCAL_RANK="0", RANK=str(rank))
            extra = dict(devices=1, num_nodes=world, accelerator="cpu")
        timer, nbytes = Timer(), Bytes()
        trainer = pl.Trainer(strategy=_strategy(kind, params), logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             callbacks=[timer, nbytes], **kw, **extra)
        begin = time.perf_counter()
        trainer.fit(model, loader)
        total = time.perf_counter() - begin
        row = {"seconds": total}
        if nbytes.wire:
            row["wire_bytes_per_step"] = sum(nbytes.wire[5:] or nbytes.wire) / len(nbytes.wire[5:] or nbytes.wire)
            row["dense_bytes_per_step"] = sum(nbytes.dense[5:] or nbytes.dense) / len(nbytes.dense[5:] or nbytes.dense)
        if mode == "acc":
            with torch.no_grad():
                row["accuracy"] = float((model(xte).argmax(dim=1) == yte).float().mean()) * 100
        else:
            t = timer.times[3:]  # skip warm-up steps
            row["samples_per_s"] = 32 * world * (len(t) - 1) / (t[-1] - t[0])
        results[label] = row
        if kind == "ddp":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        comm.Barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------- driver ---
def run_acc(epochs: int) -> dict:
    out = RESULTS / "compression_acc_raw.json"
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent), PYTHONWARNINGS="ignore")
    subprocess.run([mpiexec, "-n", "2", sys.executable, __file__, "--worker", "acc", "--out", str(out),
                    "--epochs", str(epochs)], env=env, check=True, timeout=3000)
    return json.loads(out.read_text())


def run_speed(steps: int) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.cluster import SimCluster

    out = RESULTS / "compression_speed_raw.json"
    with SimCluster(2, rate="1gbit") as cluster:
        res = cluster.run_mpi([sys.executable, __file__, "--worker", "speed", "--out", str(out), "--steps", str(steps)],
                              timeout=3000, env={"PYTHONWARNINGS": "ignore"})
        if res.returncode != 0:
            print(res.stdout[-3000:], res.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"speed run failed ({res.returncode})")
    return json.loads(out.read_text())


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--out")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-acc", action="store_true")
    args = ap.parse_args()
    if args.worker:
        rows = ACC_ROWS if args.worker == "acc" else SPEED_ROWS
        worker(args.worker, rows, args.out, args.epochs, args.steps)
        return
    RESULTS.mkdir(exist_ok=True)
    report = {"host": socket.gethostname()}
    if not args.skip_acc:
        acc = run_acc(args.epochs)
        report["accuracy"] = acc
        base = acc["mpi_asa (fp32)"]
        rows = []
        for label, r in acc.items():
            factor = base["wire_bytes_per_step"] / r["wire_bytes_per_step"]
            rows.append([label, f"{r['wire_bytes_per_step'] / 1e3:,.1f}", f"{factor:.1f}x",
                         f"{r['accuracy']:.2f}", f"{r['accuracy'] - base['accuracy']:+.2f}"])
        print(f"\nDigits, MLP 64-512-512-10 (300k params), 2 ranks, batch 16/rank, {args.epochs} epochs")
        print(table(["exchange", "kB sent/rank/step", "fewer bytes than fp32", "test acc %", "Δ vs fp32 (points)"], rows))
    if not args.skip_speed:
        speed = run_speed(args.steps)
        report["speed"] = speed
        ddp = speed["ddp (Lightning, gloo)"]["samples_per_s"]
        rows = [[label, f"{r['samples_per_s']:.1f}", f"{r['samples_per_s'] / ddp:.2f}x",
                 f"{r.get('wire_bytes_per_step', float('nan')) / 1e6:.2f}"] for label, r in speed.items()]
        print("\nSamples/s, MLP 1024-2048-2048-10 (6.3M params), 2 simulated hosts at 1 Gbit/s, batch 32/rank")
        print(table(["exchange", "samples/s", "vs ddp", "MB sent/rank/step"], rows))
    (RESULTS / "compression.json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [k for k in ("accuracy", "speed") if k in report]
        fig, axes = plt.subplots(1, 2 * len(panels) - (0 if "accuracy" in report else 0), figsize=(6 * (len(panels) + 1), 4))
        axes = list(axes) if hasattr(axes, "__len__") else [axes]
        i = 0
        if "accuracy" in report:
            acc = report["accuracy"]
            labels = list(acc)
            axes[i].barh(labels, [acc[k]["wire_bytes_per_step"] / 1e3 for k in labels])
            axes[i].set_xscale("log"); axes[i].set_xlabel("kB on the wire per rank per step (log)")
            i += 1
            axes[i].barh(labels, [acc[k]["accuracy"] for k in labels])
            axes[i].set_xlim(min(acc[k]["accuracy"] for k in labels) - 2, 100); axes[i].set_xlabel("digits test accuracy %")
            i += 1
        if "speed" in report and i < len(axes):
            sp = report["speed"]
            axes[i].barh(list(sp), [sp[k]["samples_per_s"] for k in sp]); axes[i].set_xlabel("samples/s, 2 hosts, 1 Gbit/s")
        fig.tight_layout()
        fig.savefig(RESULTS / "compression.png", dpi=100)
    except Exception as exc:  # plotting is a nicety
        print(f"(no plot: {exc})")


if __name__ == "__main__":
    main()
