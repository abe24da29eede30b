#!/usr/bin/env python3
"""Compressed exchange: bytes on the wire, samples/s on 2 simulated hosts at 1 Gbit/s, accuracy.

    python benchmarks/compression.py                 # everything (root needed for the hosts)
    python benchmarks/compression.py --skip-speed    # accuracy and bytes only
    python benchmarks/compression.py --skip-acc --repeat 5    # speed only, 5 interleaved rounds
    python benchmarks/compression.py --skip-acc --rows ddp "mpi_asa (fp32)" topk --steps 45 --skip 23
                                                     # speed of some rows only (label substrings), timed after step 23

1. Accuracy and bytes: scikit-learn's ``digits`` (``examples/digits_data.py``: 8x8 handwritten digits, 1,797 images, 25% held
   out), an MLP, 2 ranks on this machine, every codec with and without error feedback, against
   fp32 ``mpi_asa``. Bytes per step come from the rule's ``stats()``.
2. Samples/s: a 6.3M-parameter MLP on random data, 2 simulated hosts (``SimCluster``) joined by
   1 Gbit/s links, one rank each, against Lightning ``ddp`` (gloo; ``devices=1, num_nodes=2`` and
   ``MASTER_ADDR``/``NODE_RANK`` from MPI set by hand), every codec with and without error
   feedback, plus a ceiling: the same training with no exchange at all (``mpi_model_avg`` with a
   period longer than the run). The simulated hosts share this machine's cores, so other load
   slows the CPU-heavy rows more than ``ddp``, which mostly waits on the link: every row runs
   ``--repeat`` times, interleaved round by round in one job; the table gives medians, and "vs
   ddp" is the median over rounds of the ratio to that round's ``ddp``. The load average is
   printed with the table. "CPU ms/step" is the CPU time of one rank's process (all its threads)
   per step, averaged over ranks: both ranks share the machine, so it bounds the step from below.

Prints tables; writes ``benchmarks/results/compression.json`` (sections not re-run are kept from
the previous file) and ``compression.png``. Not a test.
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

#: mpi_topk as it was before issue 25's recipe: error feedback only, one threshold per bucket.
TOPK_BEFORE = {"wire": "topk", "ratio": 0.01, "momentum_correction": False, "layerwise": False,
               "ratio_warmup_steps": 0}
ACC_ROWS = [
    ("mpi_asa (fp32)", "mpi_asa", {}),
    ("int8 + EF", "compressed", {"wire": "int8"}),
    ("int8, no EF", "compressed", {"wire": "int8", "error_feedback": False}),
    ("mpi_topk (defaults)", "compressed", {"wire": "topk"}),
    ("topk 1% + EF only (before issue 25)", "compressed", TOPK_BEFORE),
    ("topk 1%, no EF", "compressed", {"wire": "topk", "ratio": 0.01, "error_feedback": False}),
    ("topk 1% + EF + DGC mc + warm-up", "compressed",
     {"wire": "topk", "ratio": 0.01, "momentum_correction": True, "momentum": 0.9, "ratio_warmup_steps": 200}),
    ("onebit + EF", "compressed", {"wire": "onebit"}),
    ("onebit, no EF", "compressed", {"wire": "onebit", "error_feedback": False}),
]
SPEED_ROWS = [
    ("ddp (Lightning, gloo)", "ddp", {}),
    ("mpi_asa (fp32)", "mpi_asa", {}),
    ("int8 + EF", "compressed", {"wire": "int8"}),
    ("int8, no EF", "compressed", {"wire": "int8", "error_feedback": False}),
    ("mpi_topk (defaults)", "compressed", {"wire": "topk"}),
    ("topk 1% + EF only (before issue 25)", "compressed", TOPK_BEFORE),
    ("topk 1%, no EF", "compressed", {"wire": "topk", "ratio": 0.01, "error_feedback": False}),
    ("onebit + EF", "compressed", {"wire": "onebit"}),
    ("onebit, no EF", "compressed", {"wire": "onebit", "error_feedback": False}),
    ("no exchange (ceiling)", "none", {}),
]


# ------------------------------------------------------------------------------------- worker ---
def _strategy(kind: str, params: dict):
    if kind == "compressed":
        from lightning_mpi import CompressedSyncStrategy

        return CompressedSyncStrategy(**params)
    if kind == "none":  # the same training without any exchange: averaging never comes due
        from lightning_mpi import ModelAveragingStrategy

        return ModelAveragingStrategy(period=10**9)
    return kind


def worker(mode: str, rows: list, out: str, epochs: int, steps: int, repeat: int = 1, skip: int = 3) -> None:
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
            self.times, self.cpu = [], []

        def on_train_batch_end(self, trainer, *args):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())

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
        from examples.digits_data import held_out_split, load_digits

        x, y = load_digits()
        xtr, xte, ytr, yte = held_out_split(x / 16.0, y)
        train = TensorDataset(torch.tensor(xtr, dtype=torch.float32), torch.tensor(ytr))
        xte, yte = torch.tensor(xte, dtype=torch.float32), torch.tensor(yte)
    schedule = [(r, row) for r in range(repeat if mode == "speed" else 1) for row in rows]
    for round_, (label, kind, params) in schedule:
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
            os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(29555 + round_), WORLD_SIZE=str(world), NODE_RANK=str(rank),
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
            # over the steps that are timed (speed: past a ratio warm-up), else from the 5th
            first = skip if mode == "speed" else 5
            wire, dense = nbytes.wire[first:] or nbytes.wire, nbytes.dense[first:] or nbytes.dense
            row["wire_bytes_per_step"] = sum(wire) / len(wire)
            row["dense_bytes_per_step"] = sum(dense) / len(dense)
        if mode == "acc":
            with torch.no_grad():
                row["accuracy"] = float((model(xte).argmax(dim=1) == yte).float().mean()) * 100
            results[label] = row
        else:
            t, c = timer.times[skip:], timer.cpu[skip:]  # skip warm-up steps
            row["samples_per_s"] = 32 * world * (len(t) - 1) / (t[-1] - t[0])
            row["step_ms"] = 1e3 * sorted(b - a for a, b in zip(t, t[1:]))[(len(t) - 1) // 2]
            row["cpu_ms_per_step"] = sum(comm.allgather(1e3 * (c[-1] - c[0]) / (len(c) - 1))) / world
            results.setdefault(label, {"runs": []})["runs"].append(row)
        if kind == "ddp":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        comm.Barrier()
    if mode == "speed":
        import statistics

        ddp = results.get(rows[0][0], {}).get("runs", [])
        for label, entry in results.items():
            runs = entry["runs"]
            for key in ("samples_per_s", "step_ms", "cpu_ms_per_step", "wire_bytes_per_step", "dense_bytes_per_step"):
                values = [r[key] for r in runs if key in r]
                if values:
                    entry[key] = statistics.median(values)
            if ddp:
                entry["vs_ddp_runs"] = [r["samples_per_s"] / d["samples_per_s"] for r, d in zip(runs, ddp)]
                entry["vs_ddp"] = statistics.median(entry["vs_ddp_runs"])
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


def run_speed(steps: int, repeat: int, rows: list[str] | None = None, skip: int = 3) -> dict:
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.cluster import SimCluster

    out = RESULTS / "compression_speed_raw.json"
    with SimCluster(2, rate="1gbit") as cluster:
        res = cluster.run_mpi([sys.executable, __file__, "--worker", "speed", "--out", str(out), "--steps", str(steps),
                               "--repeat", str(repeat), "--skip", str(skip), *(["--rows", *rows] if rows else [])],
                              timeout=3000 * repeat, env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(HERE.parent)})
        if res.returncode != 0:
            print(res.stdout[-3000:], res.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"speed run failed ({res.returncode})")
    return json.loads(out.read_text())


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _speed_table(speed: dict) -> str:
    rows = []
    for label, r in speed.items():
        wire = r.get("wire_bytes_per_step")
        runs = ", ".join(f"{x:.2f}" for x in r.get("vs_ddp_runs", []))
        rows.append([label, f"{wire / 1e6:.2f}" if wire is not None else "n/a", f"{r['samples_per_s']:.1f}",
                     f"{r.get('vs_ddp', float('nan')):.2f}x", runs, f"{r['step_ms']:.0f}", f"{r['cpu_ms_per_step']:.0f}"])
    return table(["exchange", "MB sent/rank/step", "samples/s", "vs ddp", "vs ddp per round", "step ms", "CPU ms/step/rank"], rows)


def _readme_table(report: dict) -> str:
    """One row per exchange: digits bytes and accuracy (if run), 6.3M-MLP bytes, samples/s, vs ddp."""
    acc, speed = report.get("accuracy", {}), report.get("speed", {})
    rows = []
    for label in dict.fromkeys([*speed, *acc]):
        a, s = acc.get(label, {}), speed.get(label, {})
        wire = s.get("wire_bytes_per_step")
        rows.append([
            label,
            f"{a['wire_bytes_per_step'] / 1e3:,.1f}" if "wire_bytes_per_step" in a else "",
            f"{a['accuracy']:.2f}" if "accuracy" in a else "",
            f"{wire / 1e6:.2f}" if wire is not None else "",
            f"{s['samples_per_s']:.0f}" if "samples_per_s" in s else "",
            f"{s['vs_ddp']:.2f}x" if "vs_ddp" in s else "",
        ])
    return table(["exchange", "digits kB/step", "digits acc %", "6.3M MLP MB/step", "samples/s", "vs ddp"], rows)


def plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc, speed = report.get("accuracy"), report.get("speed")
    n = (2 if acc else 0) + (1 if speed else 0)
    if not n:
        return
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    axes = list(axes[0])
    if acc:
        labels = list(acc)[::-1]
        ax = axes.pop(0)
        ax.barh(labels, [acc[k]["wire_bytes_per_step"] / 1e3 for k in labels])
        ax.set_xscale("log")
        ax.set_title("digits MLP: bytes on the wire")
        ax.set_xlabel("kB per rank per step (log)")
        ax = axes.pop(0)
        ax.barh(labels, [acc[k]["accuracy"] for k in labels])
        ax.set_xlim(min(acc[k]["accuracy"] for k in labels) - 2, 100)
        ax.set_title("digits MLP: accuracy")
        ax.set_xlabel("test accuracy %")
        ax.set_yticklabels([])
    if speed:
        labels = list(speed)[::-1]
        ax = axes.pop(0)
        ax.barh(labels, [speed[k]["samples_per_s"] for k in labels],
                color=["tab:gray" if k.startswith(("ddp", "no exchange")) else "tab:blue" for k in labels])
        ddp = next((speed[k]["samples_per_s"] for k in speed if k.startswith("ddp")), None)
        if ddp:
            for factor in (1.0, 2.5):
                ax.axvline(ddp * factor, color="tab:red", ls=":" if factor > 1 else "--", lw=1)
        ax.set_title("6.3M MLP, 2 hosts at 1 Gbit/s: speed")
        ax.set_xlabel("samples/s (dashed: ddp, dotted: 2.5x ddp)")
    fig.tight_layout()
    fig.savefig(RESULTS / "compression.png", dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description="Compressed exchange benchmark (see the module docstring).")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=15, help="accuracy part: epochs on digits")
    ap.add_argument("--steps", type=int, default=25, help="speed part: steps per run (the first 3 are not timed)")
    ap.add_argument("--repeat", type=int, default=3, help="speed part: interleaved rounds over all rows")
    ap.add_argument("--skip", type=int, default=3, help="speed part: untimed first steps (past a ratio warm-up)")
    ap.add_argument("--rows", nargs="+", help="speed part: only the rows whose label contains one of these")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-acc", action="store_true")
    args = ap.parse_args()
    if args.worker:
        rows = ACC_ROWS if args.worker == "acc" else SPEED_ROWS
        if args.rows:
            rows = [row for row in rows if any(part in row[0] for part in args.rows)]
        worker(args.worker, rows, args.out, args.epochs, args.steps, args.repeat, args.skip)
        return
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "compression.json"
    try:
        report = json.loads(path.read_text())  # keep the section this run does not redo
    except (OSError, ValueError):
        report = {}
    report["host"] = socket.gethostname()
    if not args.skip_acc:
        acc = run_acc(args.epochs)
        report["accuracy"] = acc
        report["accuracy_epochs"] = args.epochs
        base = acc["mpi_asa (fp32)"]
        rows = []
        for label, r in acc.items():
            factor = base["wire_bytes_per_step"] / r["wire_bytes_per_step"]
            rows.append([label, f"{r['wire_bytes_per_step'] / 1e3:,.1f}", f"{factor:.1f}x",
                         f"{r['accuracy']:.2f}", f"{r['accuracy'] - base['accuracy']:+.2f}"])
        print(f"\nDigits, MLP 64-512-512-10 (300k params), 2 ranks, batch 16/rank, {args.epochs} epochs")
        print(table(["exchange", "kB sent/rank/step", "fewer bytes than fp32", "test acc %", "Δ vs fp32 (points)"], rows))
    if not args.skip_speed:
        load_before = os.getloadavg()
        speed = run_speed(args.steps, args.repeat, args.rows, args.skip)
        load_after = os.getloadavg()
        report["speed"] = speed
        report["speed_conditions"] = {"repeat": args.repeat, "steps": args.steps, "loadavg_before": load_before,
                                      "loadavg_after": load_after, "cpus": os.cpu_count()}
        print(f"\nSamples/s, MLP 1024-2048-2048-10 (6.3M params), 2 simulated hosts at 1 Gbit/s, batch 32/rank, "
              f"median of {args.repeat} interleaved rounds; load average {load_before[0]:.1f} before, "
              f"{load_after[0]:.1f} after, {os.cpu_count()} cores")
        print(_speed_table(speed))
    print("\nSummary (README): bytes per rank per step, digits accuracy, samples/s and ratio to ddp")
    print(_readme_table(report))
    path.write_text(json.dumps(report, indent=1))
    try:
        plot(report)
        print(f"\nwrote {path} and {RESULTS / 'compression.png'}")
    except Exception as exc:  # plotting is a nicety
        print(f"(no plot: {exc})")


if __name__ == "__main__":
    main()
