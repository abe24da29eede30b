#!/usr/bin/env python3
"""Compressed exchange: bytes on the wire, samples/s on 2 simulated hosts at 1 Gbit/s, accuracy.

    python benchmarks/compression.py                 # everything (root needed for the hosts)
    python benchmarks/compression.py --skip-speed    # accuracy and bytes only
    python benchmarks/compression.py --skip-acc --repeat 5    # speed only, 5 interleaved rounds
    python benchmarks/compression.py --skip-acc --rows ddp "mpi_asa (fp32)" topk --steps 45 --skip 23
                                                     # speed of some rows only (label substrings), timed after step 23
    python benchmarks/compression.py --families mlp cnn lm --seeds 3 4 5 --arms tuning
    python benchmarks/compression.py --families mlp cnn lm --seeds 0 1 2 --arms defaults
    python benchmarks/compression.py --report        # tables and one plot per wire, from what was run

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

3. Across model families (``--families``): every lossy wire against ``mpi_asa`` on three kinds of
   model, each trained on 2 ranks of this machine from ``seed_everything(seed)`` (the same initial
   weights and data order for every arm of a seed), one ``mpiexec`` per family and seed:

   - ``mlp``: an MLP 64-512-512-10 (300k parameters) on the digits of ``examples/digits.py`` (its
     80/20 split), SGD with momentum 0.9 at lr 0.05, batch 32 per rank, 8 epochs (184 steps);
     accuracy of the final weights on the 360 held-out images;
   - ``cnn``: the digits example's CNN (10k parameters), the same data, optimizer and steps;
   - ``lm``: a causal transformer language model over bytes (2 layers, width 64, 4 heads, context
     64; 110k parameters) on the Python standard library's source (``benchmarks/ttq_task.py``'s
     text, 1 MB to train, its held-out files to test), AdamW at lr 2e-3, batch 16 per rank, 300
     steps; held-out loss of the final weights in nats per byte (lower is better).

   The outer rules run every 10 steps here (their default 50 would leave 3-6 outer steps in these
   runs; SparseLoCo's wire has 10 as its default).

   Bytes per step are the mean over the run of the rule's ``stats()["wire_bytes"]`` (one rank's
   bytes out; a rule that exchanges every ``period`` steps is averaged over all of them). Arms
   are registered names with overrides, ``NAME@key=value+key=value`` (values as Python literals);
   ``--arms tuning`` / ``defaults`` name the two lists below (:data:`TUNING_ARMS`,
   :data:`DEFAULT_ARMS`). Results accumulate in ``benchmarks/results/compression_families.json``
   (one entry per family, seed and arm; a rerun replaces its own); ``--report`` prints one table
   per wire and writes one plot per wire (``compression_<wire>.png``).

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


#: The dense outer wires run every 10 steps in the families' runs (184-300 steps: 18-30 outer steps;
#: their default 50 would leave 3-6), on 4 fragments for Streaming DiLoCo; SparseLoCo's wire runs at
#: its own default period, 10 too.
OUTER = "period=10"
SPARSE = "wire='sparseloco'"
#: Every arm of the families' runs on the tuning seeds: each wire at its defaults, the defaults it
#: had before, and the alternatives its defaults were chosen from.
TUNING_ARMS = [
    "mpi_asa",
    "mpi_asa_int8", "mpi_asa_int8@error_feedback=False",
    "mpi_onebit", "mpi_onebit@error_feedback=False",
    "mpi_topk", "mpi_topk@topk_packing='pairs'", "mpi_topk@ratio_warmup_steps=100",
    "mpi_topk@momentum_correction=True+momentum_masking=False",
    "mpi_powersgd", "mpi_powersgd@rank=2", "mpi_powersgd@rank=4",
    f"mpi_diloco@{OUTER}", f"mpi_streaming_diloco@{OUTER}+wire='fp32'", f"mpi_streaming_diloco@{OUTER}",
    f"mpi_diloco@{SPARSE}+outer_lr=1.0", f"mpi_streaming_diloco@{SPARSE}+outer_lr=1.0",
    f"mpi_streaming_diloco@{SPARSE}+outer_lr=1.5",
    f"mpi_streaming_diloco@{SPARSE}+outer_lr=1.0+error_decay=0.8",
    f"mpi_streaming_diloco@{SPARSE}+outer_lr=1.0+error_decay=0.9",
    f"mpi_streaming_diloco@{SPARSE}+outer_lr=1.0+error_decay=0.99",
]
#: The held-out check: every wire at its defaults, and the alternatives closest to them.
DEFAULT_ARMS = [
    "mpi_asa", "mpi_asa_int8", "mpi_onebit", "mpi_onebit@error_feedback=False",
    "mpi_topk", "mpi_topk@topk_packing='pairs'", "mpi_topk@ratio_warmup_steps=100",
    "mpi_powersgd", "mpi_powersgd@rank=2", "mpi_powersgd@rank=4",
    f"mpi_diloco@{OUTER}", f"mpi_streaming_diloco@{OUTER}+wire='fp32'", f"mpi_streaming_diloco@{OUTER}",
    f"mpi_diloco@{SPARSE}", f"mpi_streaming_diloco@{SPARSE}",
]
FAMILIES = ("mlp", "cnn", "lm")
#: The plot and table each arm belongs to (by its name and wire), in the report's order.
WIRES = ("int8", "onebit", "topk", "powersgd", "outer dense", "sparseloco")


def parse_arm(spec: str) -> tuple[str, dict]:
    """``NAME@key=value+key=value`` -> (registered name, overrides); values as Python literals."""
    import ast

    name, _, rest = spec.partition("@")
    kwargs = {}
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        kwargs[key] = ast.literal_eval(value)
    return name, kwargs


def wire_of(spec: str) -> str | None:
    """The wire an arm is judged under (:data:`WIRES`), or None for the baseline ``mpi_asa``."""
    name, kwargs = parse_arm(spec)
    if name == "mpi_asa":
        return None
    if name in ("mpi_diloco", "mpi_streaming_diloco"):
        return "sparseloco" if kwargs.get("wire") == "sparseloco" else "outer dense"
    return {"mpi_asa_int8": "int8", "mpi_onebit": "onebit", "mpi_topk": "topk", "mpi_powersgd": "powersgd"}[name]


def family_task(family: str, seed: int):
    """``(module, train_loader, score)`` of one family (module docstring); ``score(module)`` on rank 0."""
    import pytorch_lightning as pl
    import torch
    from torch import nn

    sys.path.insert(0, str(HERE.parent / "examples"))
    from digits import DigitsCNN, DigitsData

    pl.seed_everything(seed, verbose=False)
    if family in ("mlp", "cnn"):
        data = DigitsData(batch_size=32)
        data.setup("fit")
        module = DigitsCNN()
        if family == "mlp":
            module.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                       nn.Linear(512, 10))
        x, y = data.val_set.tensors

        def accuracy(m) -> float:
            m.eval()
            with torch.no_grad():
                return 100.0 * float((m.net(x).argmax(1) == y).float().mean())

        return module, data.train_dataloader(), accuracy
    if family != "lm":
        raise ValueError(f"family={family!r}: choose one of {FAMILIES}")
    from benchmarks.ttq_task import TaskConfig, load_texts

    cfg = TaskConfig(train_bytes=1 << 20, held_out_bytes=64 << 10)
    train_text, held_text, _ = load_texts(cfg, RESULTS / "compression_lm_text.pt")
    context = 64

    class CausalLM(nn.Module):
        def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.position = nn.Parameter(torch.zeros(context, width))
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

        def forward(self, x):
            h = self.embed(x) + self.position[: x.shape[1]]
            return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = CausalLM()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    def windows(text, offsets):
        rows = torch.stack([text[o : o + context + 1].long() for o in offsets.tolist()])
        return rows[:, :-1], rows[:, 1:]

    g = torch.Generator().manual_seed(seed)
    train = torch.utils.data.TensorDataset(*windows(train_text, torch.randint(0, len(train_text) - context - 1,
                                                                              (2 * 16 * 300,), generator=g)))
    held_x, held_y = windows(held_text, torch.linspace(0, len(held_text) - context - 2, 256).long())
    module = LM()

    def loss(m) -> float:
        m.eval()
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m.net(held_x).flatten(0, 1), held_y.flatten()))

    return module, torch.utils.data.DataLoader(train, batch_size=16, shuffle=True), loss


def family_worker(family: str, seed: int, arms: list[str], out: str) -> None:
    """Every arm of ``arms`` on one family and seed, in turn; rank 0 appends one JSON line per arm."""
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    import lightning_mpi
    from lightning_mpi import STRATEGIES

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()

    class Bytes(pl.Callback):
        def __init__(self) -> None:
            self.wire: list[float] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            bound = getattr(trainer.strategy, "bound_rule", None)
            self.wire.append(float(bound.stats().get("wire_bytes", 0.0)) if bound is not None else 0.0)

    for spec in arms:
        name, overrides = parse_arm(spec)
        class_name, params, _ = STRATEGIES[name]
        strategy = getattr(lightning_mpi, class_name)(**{**params, **overrides})
        module, loader, score = family_task(family, seed)
        nbytes = Bytes()
        epochs = {"max_epochs": 8} if family in ("mlp", "cnn") else {"max_steps": 300}
        trainer = pl.Trainer(strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[nbytes], accelerator="cpu", **epochs)
        begin = time.perf_counter()
        trainer.fit(module, loader)
        seconds = time.perf_counter() - begin
        if rank == 0:
            row = {"family": family, "seed": seed, "arm": spec, "metric": score(module), "steps": trainer.global_step,
                   "bytes_per_step": sum(nbytes.wire) / max(1, len(nbytes.wire)), "seconds": round(seconds, 1)}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{family} seed {seed} {spec}: {row['metric']:.4f} ({seconds:.1f} s)", flush=True)


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


FAMILY_RESULTS = RESULTS / "compression_families.json"
#: The seeds the defaults were chosen on, and the seeds they are checked on.
TUNING_SEEDS, HELD_OUT_SEEDS = (3, 4, 5), (0, 1, 2)


def run_families(families: list[str], seeds: list[int], arms: list[str], per_arm: float) -> None:
    """One ``mpiexec -n 2`` per family and seed; each result is merged into :data:`FAMILY_RESULTS` as
    soon as its job ends (a job that runs past ``per_arm`` seconds an arm is killed, what it wrote kept)."""
    import signal
    import tempfile

    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent), PYTHONWARNINGS="ignore")
    for family in families:
        for seed in seeds:
            with tempfile.TemporaryDirectory() as scratch:
                out = Path(scratch) / "rows.jsonl"
                cmd = [mpiexec, "-n", "2", sys.executable, __file__, "--worker", "family", "--family", family,
                       "--seed", str(seed), "--out", str(out), "--arms", *arms]
                proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                try:
                    text, _ = proc.communicate(timeout=60 + per_arm * len(arms))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    text, _ = proc.communicate()
                    print(f"{family} seed {seed}: killed after {60 + per_arm * len(arms):.0f} s", file=sys.stderr)
                print("\n".join(line for line in text.splitlines() if " seed " in line), flush=True)
                rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            merge_family_rows(rows)


def merge_family_rows(rows: list[dict]) -> None:
    """Add ``rows`` to :data:`FAMILY_RESULTS`, replacing an earlier row of the same family, seed and arm."""
    try:
        saved = json.loads(FAMILY_RESULTS.read_text())
    except (OSError, ValueError):
        saved = []
    key = lambda r: (r["family"], r["seed"], r["arm"])  # noqa: E731
    fresh = {key(r) for r in rows}
    FAMILY_RESULTS.write_text(json.dumps([r for r in saved if key(r) not in fresh] + rows, indent=1))


def family_diffs(rows: list[dict], family: str, arm: str, seeds) -> list[float]:
    """Per seed (of ``seeds`` where both ran): the arm's metric minus ``mpi_asa``'s; for ``lm`` (a loss)
    in percent of ``mpi_asa``'s loss, so that for every family a negative difference is a loss of quality."""
    by = {(r["arm"], r["seed"]): r["metric"] for r in rows if r["family"] == family}
    out = []
    for seed in seeds:
        if (arm, seed) in by and ("mpi_asa", seed) in by:
            a, base = by[(arm, seed)], by[("mpi_asa", seed)]
            out.append(a - base if family != "lm" else -100.0 * (a - base) / base)
    return out


def family_bytes(rows: list[dict], family: str, arm: str) -> float | None:
    values = [r["bytes_per_step"] for r in rows if r["family"] == family and r["arm"] == arm]
    return sum(values) / len(values) if values else None


def family_report(rows: list[dict]) -> str:
    """One markdown table per wire (module docstring), and one plot per wire."""
    import statistics

    arms = list(dict.fromkeys(r["arm"] for r in rows))
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    parts = ["Quality against `mpi_asa`, mean over seeds (accuracy points for mlp and cnn; for lm, minus the "
             "held-out loss's difference in percent: negative is worse everywhere), then bytes per rank per step."]
    base = []
    for family in families:
        for seeds, label in ((HELD_OUT_SEEDS, "0-2"), (TUNING_SEEDS, "3-5")):
            values = [r["metric"] for r in sorted(rows, key=lambda r: r["seed"])
                      if r["family"] == family and r["arm"] == "mpi_asa" and r["seed"] in seeds]
            if values:
                unit = "loss" if family == "lm" else "acc %"
                base.append(f"{family} seeds {label}: {unit} {statistics.mean(values):.3f} "
                            f"({', '.join(f'{v:.3f}' for v in values)})")
    parts.append("`mpi_asa`: " + "; ".join(base))
    for wire in WIRES:
        mine = [a for a in arms if wire_of(a) == wire]
        if not mine:
            continue
        headers = ["arm"] + [f"{f} {label}" for f in families for label in ("0-2", "3-5")]
        headers += [f"{f} B/step" for f in families]
        body = []
        for arm in mine:
            cells = [f"`{arm}`"]
            for family in families:
                for seeds in (HELD_OUT_SEEDS, TUNING_SEEDS):
                    d = family_diffs(rows, family, arm, seeds)
                    cells.append(f"{statistics.mean(d):+.2f} [{', '.join(f'{x:+.1f}' for x in d)}]" if d else "")
            for family in families:
                b = family_bytes(rows, family, arm)
                cells.append(f"{b:,.0f}" if b is not None else "")
            body.append(cells)
        parts.append(f"#### {wire}\n\n" + table(headers, body))
        plot_wire(rows, wire, mine, families)
    return "\n\n".join(parts)


def plot_wire(rows: list[dict], wire: str, arms: list[str], families: list[str]) -> None:
    """Per family: each arm's difference to ``mpi_asa`` (bar: the mean over the held-out seeds, dots:
    every seed, held out filled and tuning hollow), and its bytes per step beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(families), figsize=(5.2 * len(families), 0.55 * len(arms) + 1.8), squeeze=False)
    labels = [a.replace("mpi_", "").replace("streaming_diloco", "sdiloco").replace("@", " ").replace("+", " ")
              for a in arms]
    for ax, family in zip(axes[0], families):
        for i, arm in enumerate(arms):
            held = family_diffs(rows, family, arm, HELD_OUT_SEEDS)
            tuning = family_diffs(rows, family, arm, TUNING_SEEDS)
            if held:
                ax.barh(i, sum(held) / len(held), color="tab:blue", alpha=0.6)
            ax.scatter(held, [i] * len(held), color="tab:blue", s=14, zorder=3)
            ax.scatter(tuning, [i] * len(tuning), facecolors="none", edgecolors="tab:orange", s=14, zorder=3)
            b = family_bytes(rows, family, arm)
            if b is not None:
                ax.annotate(f"{b:,.0f} B", (1.0, i), xycoords=("axes fraction", "data"), fontsize=7,
                            ha="right", va="center", color="gray")
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(arms)))
        ax.set_yticklabels(labels if family == families[0] else [], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{family}: against mpi_asa", fontsize=9)
        ax.set_xlabel("accuracy points" if family != "lm" else "-(loss difference) %", fontsize=8)
    fig.suptitle(f"{wire}: bars and filled dots seeds 0-2 (held out), hollow dots seeds 3-5 (tuning); "
                 "grey: bytes per rank per step", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"compression_{wire.replace(' ', '_')}.png", dpi=100)
    plt.close(fig)


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
    ap.add_argument("--families", nargs="+", choices=FAMILIES, help="run the families' part (module docstring, 3.)")
    ap.add_argument("--family", help=argparse.SUPPRESS)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(HELD_OUT_SEEDS), help="families: seeds to run")
    ap.add_argument("--arms", nargs="+", default=["defaults"],
                    help="families: arms (NAME@key=value+...), or 'tuning' / 'defaults' for the lists")
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--per-arm", type=float, default=240.0, help="families: seconds an arm may take before the job is killed")
    ap.add_argument("--report", action="store_true", help="families: print the tables and write the plots, run nothing")
    args = ap.parse_args()
    arms = [a for spec in args.arms for a in {"tuning": TUNING_ARMS, "defaults": DEFAULT_ARMS}.get(spec, [spec])]
    if args.worker == "family":
        family_worker(args.family, args.seed, arms, args.out)
        return
    if args.families or args.report:
        RESULTS.mkdir(exist_ok=True)
        if args.families:
            run_families(args.families, args.seeds, arms, args.per_arm)
        print(family_report(json.loads(FAMILY_RESULTS.read_text())))
        return
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
