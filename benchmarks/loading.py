"""Epoch time of ``PrefetchDataModule`` against plain and worker DataLoaders, under MPI.

Run it on 2 ranks (it needs the ``mpi_allreduce`` strategy from ``import lightning_mpi``)::

    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/loading.py                # step on a (stand-in) device
    OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/loading.py --step cpu     # step on the CPU

Setup
    A dataset of image files: each sample is a zlib-compressed ``3x72x72`` uint8 array on disk.
    Reading one costs a per-file storage latency (``--read-latency-ms``, a sleep standing for a
    network filesystem fetch; the file itself is read from the page cache), the inflate
    (real CPU work, GIL released) and the Theano-MPI transform on torch tensors: mean-image
    subtraction, random 64x64 crop, random mirror (real CPU work).

    The training step is Lightning's, under ``Trainer(strategy="mpi_allreduce")``: a linear model
    on the batch, backward, an ``MPI_Allreduce`` of the gradients, SGD. To it the step adds the
    work a real model would do, calibrated so that it costs what loading one batch costs (read +
    transform = one training step, as the issue asks):

    * ``--step device`` (default): the host waits that long, as it does while a GPU computes
      (``cuda.synchronize``); the CPU core is free for the loader. This is the situation that
      Theano-MPI's and this module's overlap target, and the only one in which a 2-core host
      with 2 ranks can overlap loading at all.
    * ``--step cpu``: that many milliseconds of real matmuls on the rank's core, which the
      loader's CPU work must then share. Expect less gain: only the storage latency can hide.

Compared, with the same dataset, transform, batch size and model:
    * ``PrefetchDataModule(prefetch=2)`` (background threads),
    * ``DataLoader(num_workers=0)`` (Lightning injects its DistributedSampler),
    * ``DataLoader(num_workers=1, pin_memory=True)`` (a worker process forked from the MPI rank;
      ``pin_memory`` is a no-op without a GPU).

Reported per loader: median epoch time (epochs after the first), its ratio to the plain loader,
the mean gap between two training steps (time the loop waits for data plus loop overhead),
and the peak proportional set size (PSS, MiB) of the rank and its children during ``fit``,
which charges a forked worker only for the pages it does not share. A table goes to stdout, a
PNG and a JSON file to ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
IMG = (3, 72, 72)
CROP = 64


# --------------------------------------------------------------------------------------------
# dataset


def write_dataset(root: Path, n: int, seed: int = 0) -> None:
    """Smooth images with noise: they compress, so inflating them is real work."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0 : IMG[1], 0 : IMG[2]]
    for i in range(n):
        base = (np.sin(xx / (3 + i % 7)) + np.cos(yy / (4 + i % 5))) * 60 + 128
        img = np.stack([base + 10 * c for c in range(3)]) + rng.normal(0, 4, IMG)
        data = np.clip(img, 0, 255).astype(np.uint8).tobytes()
        (root / f"{i:06d}.z").write_bytes(zlib.compress(data, 6))
    np.save(root / "labels.npy", rng.integers(0, 10, n))


class FileImages:
    """Map-style dataset over ``root``: ``(uint8 CHW image tensor, label)``."""

    def __init__(self, root: Path, latency_s: float) -> None:
        self.root = Path(root)
        self.labels = np.load(self.root / "labels.npy")
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.latency_s:
            time.sleep(self.latency_s)  # storage latency (network filesystem), see module docs
        raw = zlib.decompress((self.root / f"{i:06d}.z").read_bytes())
        img = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(IMG)
        return img, int(self.labels[i])


class Transformed(torch.utils.data.Dataset):
    """What the DataLoader baselines load: the same dataset with the transform applied inside."""

    def __init__(self, ds: FileImages, transform) -> None:
        self.ds, self.transform = ds, transform

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        img, y = self.ds[i]
        return self.transform(img), y


def make_transform(mean_image: torch.Tensor):
    from lightning_mpi.data import transforms as T

    return T.Compose([T.MeanSubtract(mean_image), T.RandomCrop(CROP), T.RandomMirror()])


# --------------------------------------------------------------------------------------------
# memory


def _pss_kib(pid: int | str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


class PeakMemory:
    """Samples PSS of this process and its children every ``period`` seconds."""

    def __init__(self, period: float = 0.05) -> None:
        self.period, self.peak_kib = period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = _pss_kib("self") + sum(_pss_kib(p) for p in _children())
            self.peak_kib = max(self.peak_kib, total)
            self._stop.wait(self.period)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# --------------------------------------------------------------------------------------------
# model and timing


def burn(ms: float, calib: dict) -> None:
    """``ms`` milliseconds of matmuls on this core (iterations calibrated once)."""
    a = calib["a"]
    for _ in range(max(1, round(ms * calib["iters_per_ms"]))):
        a = torch.tanh(a @ calib["b"])


def calibrate_burn() -> dict:
    a, b = torch.randn(64, 128), torch.randn(128, 128) / 12
    calib = {"a": a, "b": b, "iters_per_ms": 1.0}
    burn(20, calib)
    t0 = time.perf_counter()
    burn(200, calib)
    calib["iters_per_ms"] = 200 / ((time.perf_counter() - t0) * 1000)
    return calib


def make_model(step: str, step_ms: float, calib: dict):
    import pytorch_lightning as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3 * CROP * CROP, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.fc(x.float().flatten(1)), y)
            if step == "device":
                time.sleep(step_ms / 1000)  # the host waiting for the accelerator
            else:
                burn(step_ms, calib)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    return Net()


def make_timer():
    import pytorch_lightning as pl

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.epochs: list[float] = []
            self.gaps: list[float] = []
            self.steps: list[float] = []
            self._t0 = self._last_end = self._start = None

        def on_train_epoch_start(self, trainer, pl_module):
            self._t0 = time.perf_counter()
            self._last_end = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self._last_end is not None and trainer.current_epoch > 0:
                self.gaps.append(time.perf_counter() - self._last_end)
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._last_end = time.perf_counter()
            if trainer.current_epoch > 0:
                self.steps.append(self._last_end - self._start)

        def on_train_epoch_end(self, trainer, pl_module):
            self.epochs.append(time.perf_counter() - self._t0)

    return Timer()


def run_one(name: str, args, ds: FileImages, transform, calib: dict, step_ms: float, comm) -> dict:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from lightning_mpi.data import PrefetchDataModule

    torch.manual_seed(0)
    model = make_model(args.step, step_ms, calib)
    timer = make_timer()
    trainer = pl.Trainer(
        strategy="mpi_allreduce",
        accelerator="cpu",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    dm = None
    if name == "PrefetchDataModule":
        dm = PrefetchDataModule(ds, batch_size=args.batch_size, prefetch=args.prefetch, transform=transform, seed=0)
        fit_kwargs = {"datamodule": dm}
    else:
        workers = 0 if name == "DataLoader(num_workers=0)" else 1
        loader = DataLoader(
            Transformed(ds, transform),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=workers,
            pin_memory=workers > 0,
        )
        fit_kwargs = {"train_dataloaders": loader}
    comm.Barrier()
    with PeakMemory() as mem:
        trainer.fit(model, **fit_kwargs)
    comm.Barrier()
    timed = timer.epochs[1:] or timer.epochs
    return {
        "loader": name,
        "epoch_s": statistics.median(timed),
        "epochs_s": timer.epochs,
        "gap_ms": 1000 * statistics.mean(timer.gaps) if timer.gaps else float("nan"),
        "step_ms": 1000 * statistics.mean(timer.steps) if timer.steps else float("nan"),
        "peak_pss_mib": mem.peak_kib / 1024,
        "batches": trainer.num_training_batches,
        "wait_ms": 1000 * dm.wait_stats["train"].mean_wait_s if dm is not None else float("nan"),
    }


def measure_load_ms(ds: FileImages, transform, batch_size: int, batches: int) -> float:
    """Milliseconds to read, transform and collate one batch, nothing else running."""
    from torch.utils.data import default_collate

    t0 = time.perf_counter()
    for k in range(batches):
        default_collate([(transform(img), y) for img, y in (ds[k * batch_size + j] for j in range(batch_size))])
    return 1000 * (time.perf_counter() - t0) / batches


# --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", choices=("device", "cpu"), default="device")
    parser.add_argument("--samples", type=int, default=1280, help="dataset size (all ranks together)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per loader; the first is not timed")
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--read-latency-ms", type=float, default=1.0, help="storage latency per file")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the three loaders")
    args = parser.parse_args()

    from mpi4py import MPI

    import lightning_mpi  # noqa: F401 - registers mpi_* strategies
    from pytorch_lightning.strategies import StrategyRegistry

    if "mpi_allreduce" not in StrategyRegistry:
        sys.exit("benchmarks/loading.py needs the mpi_allreduce strategy (import lightning_mpi registers it)")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)

    root = Path(tempfile.mkdtemp(prefix="lmpi-loading-")) if rank == 0 else None
    if rank == 0:
        write_dataset(root, args.samples)
    root = Path(comm.bcast(str(root) if root else None, root=0))
    try:
        ds = FileImages(root, args.read_latency_ms / 1000)
        mean_image = torch.full(IMG, 128.0)
        transform = make_transform(mean_image)
        calib = calibrate_burn()
        measure_load_ms(ds, transform, args.batch_size, 4)  # warm the page cache and the allocator
        load_ms = comm.allreduce(measure_load_ms(ds, transform, args.batch_size, 16), op=MPI.SUM) / world
        step_ms = load_ms  # "a dataset whose read + transform costs about one training step"

        names = ["PrefetchDataModule", "DataLoader(num_workers=0)", "DataLoader(num_workers=1, pin_memory=True)"]
        rows: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(args.repeats):
            order = names if rep % 2 == 0 else names[::-1]  # alternate to cancel drift on a shared host
            for name in order:
                res = run_one(name, args, ds, transform, calib, step_ms, comm)
                all_res = comm.gather(res, root=0)
                if rank == 0:
                    rows[name].append(
                        {
                            **res,
                            "epoch_s": max(r["epoch_s"] for r in all_res),  # the slowest rank sets the pace
                            "peak_pss_mib": max(r["peak_pss_mib"] for r in all_res),
                        }
                    )
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)

    if rank != 0:
        return
    summary = []
    for name in names:
        rs = rows[name]
        summary.append(
            {
                "loader": name,
                "epoch_s": statistics.median(r["epoch_s"] for r in rs),
                "gap_ms": statistics.median(r["gap_ms"] for r in rs),
                "step_ms": statistics.median(r["step_ms"] for r in rs),
                "peak_pss_mib": max(r["peak_pss_mib"] for r in rs),
                "batches": rs[0]["batches"],
                "runs": rs,
            }
        )
    plain = summary[1]["epoch_s"]
    worker = summary[2]["epoch_s"]
    batch_mib = args.batch_size * 4 * 3 * CROP * CROP / 2**20
    print(
        f"\nloading benchmark: mpiexec -n {world}, step={args.step}, {args.samples} samples, batch {args.batch_size}/rank, "
        f"{summary[0]['batches']} batches/rank/epoch, read+transform {load_ms:.1f} ms/batch, added step work "
        f"{step_ms:.1f} ms, read latency {args.read_latency_ms:g} ms/file, prefetch {args.prefetch}, "
        f"median of epochs 2..{args.epochs} x {args.repeats} round(s)"
    )
    header = (
        f"| {'loader':<44} | epoch (s) | vs plain | vs worker | gap between steps (ms) | step (ms) "
        "| peak PSS (MiB) |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for s in summary:
        print(
            f"| {s['loader']:<44} | {s['epoch_s']:9.3f} | {s['epoch_s'] / plain:7.2f}x | {s['epoch_s'] / worker:8.2f}x "
            f"| {s['gap_ms']:22.1f} | {s['step_ms']:9.1f} | {s['peak_pss_mib']:14.1f} |"
        )
    ratio_plain, ratio_worker = summary[0]["epoch_s"] / plain, summary[0]["epoch_s"] / worker
    print(
        f"targets: <= 0.60x plain -> {ratio_plain:.2f}x ({'met' if ratio_plain <= 0.6 else 'MISSED'}), "
        f"<= 1.00x worker -> {ratio_worker:.2f}x ({'met' if ratio_worker <= 1.0 else 'MISSED'}); "
        f"prefetch buffer bound {args.prefetch} x {batch_mib:.2f} MiB = {args.prefetch * batch_mib:.2f} MiB per rank"
    )

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"loading_{args.step}"
    (RESULTS / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "load_ms": load_ms, "step_ms": step_ms, "world": world, "summary": summary}, indent=1)
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["Prefetch\nDataModule", "DataLoader\nworkers=0", "DataLoader\nworkers=1, pin"]
    colors = ["tab:green", "tab:gray", "tab:blue"]
    ax1.bar(labels, [s["epoch_s"] for s in summary], color=colors)
    ax1.axhline(0.6 * plain, ls="--", color="k", lw=1, label="target 0.6x plain")
    ax1.axhline(0.5 * plain, ls=":", color="k", lw=1, label="limit 0.5x plain")
    ax1.set_ylabel("epoch time (s)")
    ax1.set_title(f"epoch time, mpiexec -n {world}, step={args.step}")
    ax1.legend(fontsize=8)
    ax2.bar(labels, [s["peak_pss_mib"] for s in summary], color=colors)
    ax2.set_ylabel("peak PSS per rank incl. workers (MiB)")
    ax2.set_title("memory")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)
    print(f"saved {RESULTS / (stem + '.png')} and {stem}.json")


if __name__ == "__main__":
    main()
