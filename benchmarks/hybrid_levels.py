#!/usr/bin/env python3
"""Two levels against flat rules at equal steps: held-out loss and bytes over the slow link (issue 40).

Four ranks laid out as two simulated hosts of two ranks (launch ranks 0, 1 on host A and 2, 3 on
host B) train the time-to-quality task (``benchmarks/ttq_task.py``: the byte-level language model,
17M parameters, batch 16 per rank, AdamW) for a fixed number of steps, with no clock, in these arms::

    mpi_hybrid:group_size=2,period=H       two levels: every-step ASA (fp32) inside a host,
                                           Streaming DiLoCo (int4, 4 fragments, τ = 1, α = 0.5)
                                           across the two hosts, each rank carrying its half
    mpi_streaming_diloco:period=H          flat: 4 workers, the same outer options and wire (int4)
    mpi_streaming_diloco:period=H,wire=fp32   flat, fp32 wire (one Allreduce of Δ)
    mpi_asa                                every step, all 4 ranks, fp32 (batch 64 in effect)
    local                                  one process, batch 16 (a reference only; ``--no-local``)

every one from the same seed (initial weights and training windows), for each seed of ``--seeds``,
one ``mpiexec -n 4`` per arm and seed (``mpiexec -n 1`` for ``local``) running this script in
worker mode (``--worker``), the way ``benchmarks/ttq_fixed_steps.py`` trains an arm::

    python benchmarks/hybrid_levels.py                          # 200 steps, period 20, seeds 0 1 2
    python benchmarks/hybrid_levels.py --steps 200 --seeds 0 --arms hybrid flat_int4
    python benchmarks/hybrid_levels.py --report                 # table and plot from the JSON

``group_size=2`` makes the hosts for ``mpi_hybrid`` on one machine; the flat arms need none: what
is measured here (loss at equal steps, bytes) does not depend on where the ranks run or on time.

**Loss.** Held-out loss (nats per byte, ``ttq_task.held_out_loss``) of the weights ``fit`` leaves
(for the outer rules: the replicas' mean, after the end-of-training fold), at ``--steps``; and, at
every step of ``--marks``, of rank 0's own weights (for the outer rules, its replica's weights
between outer steps: the curve in the plot). Mean over the seeds, and each seed.

**Bytes over the slow link**, per training step, all ranks together, from each rank's
``stats()["wire_bytes"]`` (the bytes that rank sent in the step: for ``mpi_hybrid`` its outer,
cross-replica bytes only; the every-step gradient exchange inside a replica is ``inner_wire_bytes``,
and the outer Allgather inside the replica is not counted by the rule, both on shared memory),
read after every step on every rank, summed over ranks and averaged over the steps. What share of
a rank's bytes goes to the other host is computed, not measured:

- ``mpi_hybrid``: every byte of ``wire_bytes`` crosses. Piece ``k`` of Δ is averaged by the ranks
  that carry it, one per replica (ranks 0 and 2, ranks 1 and 3), so every peer of that exchange is
  on the other host: ``cross = Σ_ranks wire_bytes``.
- the flat rules (Streaming DiLoCo on any wire, ``mpi_asa``): each rank's bytes are split evenly
  over its ``W − 1`` peers, of which ``W − g`` are on the other host: ``cross = (W − g)/(W − 1) ·
  Σ_ranks wire_bytes`` (2/3 for W = 4, g = 2). This is exact for the Alltoall of ASA (one chunk to
  each peer) and for an Allgather that sends straight to each peer or by recursive doubling from
  distance 1. Which algorithm MPI picks for each call was not checked, and another one moves this:
  a ring Allgather over 0-1-2-3 sends 1/2 of its bytes across, an Allreduce that reduce-scatters by
  halving at distance 1 first (Rabenseifner's) 1/3, and a topology-aware flat exchange could go
  lower still. The rules' ``wire_bytes`` themselves are the bandwidth-optimal counts
  (``rules/diloco/fragments.exchange_bytes``: ``2 (W−1)/W · n · 4`` for fp32, ``2 (W−1)`` encoded
  chunks of ``n/W`` for the lossy wires).

The end of ``fit`` folds each fragment's steps since its last exchange in (one more exchange per
fragment); those bytes are reported apart (``end_bytes``), not in the per-step figure.

Writes ``benchmarks/results/hybrid_levels.json`` (every arm and seed; a rerun replaces its own
entries) and ``benchmarks/results/hybrid_levels.png`` (loss against step, mean over seeds), and
prints one markdown table. Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
DATA = RESULTS / "ttq_data_fixed_steps.pt"

#: ranks and ranks per simulated host
WORLD, HOST = 4, 2


def arms(period: int) -> dict[str, tuple[str, int]]:
    """Label -> (arm spec as ``ttq_fixed_steps`` reads it, ranks)."""
    return {
        "hybrid": (f"mpi_hybrid:group_size={HOST},period={period}", WORLD),
        "flat_int4": (f"mpi_streaming_diloco:period={period}", WORLD),
        "flat_fp32": (f"mpi_streaming_diloco:period={period},wire='fp32'", WORLD),
        "asa": ("mpi_asa", WORLD),
        "local": ("local", 1),
    }


def cross_share(arm: str, world: int) -> float:
    """The share of a rank's ``wire_bytes`` that goes to the other host (module docstring)."""
    if world == 1:
        return 0.0
    if arm.startswith("mpi_hybrid"):
        return 1.0
    return (world - HOST) / (world - 1)


# ------------------------------------------------------------------------------------- worker ---
def worker(arm: str, steps: int, marks: list[int], seed: int, out: Path) -> None:
    """Train ``arm`` for ``steps`` steps on every rank (as ``ttq_fixed_steps.fixed_steps``) and record
    every rank's bytes per step; rank 0 writes one JSON object to ``out``."""
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch
    from mpi4py import MPI

    from benchmarks import ttq_task
    from benchmarks.ttq_worker import QUIET_TRAINER, train_loader, trainer_kwargs

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    cfg = ttq_task.TaskConfig(seed=seed)
    if rank == 0:
        ttq_task.load_texts(cfg, DATA)
    comm.Barrier()
    train_text, held_text, _ = ttq_task.load_texts(cfg, DATA)
    held = ttq_task.held_out_batch(held_text, cfg)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.wire: list[float] = []
            self.inner: list[float] = []
            self.bound = None
            self.snapshots: dict[int, list] = {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter())
            bound = getattr(trainer.strategy, "bound_rule", None)
            if bound is not None:
                self.bound = bound
                s = bound.stats()
                self.wire.append(float(s.get("wire_bytes", 0.0)))
                self.inner.append(float(s.get("inner_wire_bytes", 0.0)))
            if rank == 0 and len(self.times) in marks:
                self.snapshots[len(self.times)] = [p.detach().clone() for p in module.parameters()]

    rec = Record()
    trainer = pl.Trainer(max_steps=steps, callbacks=[rec], **QUIET_TRAINER, **trainer_kwargs(arm))
    module = ttq_task.make_module(cfg)
    begin = time.perf_counter()
    trainer.fit(module, train_loader(train_text, cfg, 16))
    seconds = time.perf_counter() - begin
    mine = {"wire": rec.wire, "inner": rec.inner, "end_bytes": 0.0, "stats": {}, "table": None}
    if rec.bound is not None:
        final = rec.bound.stats()  # after fit: the last step's bytes plus the end-of-training fold's
        mine["end_bytes"] = float(final.get("wire_bytes", 0.0)) - (rec.wire[-1] if rec.wire else 0.0)
        mine["stats"] = {k: float(v) for k, v in final.items()}
        layout = getattr(rec.bound, "layout", None)
        mine["table"] = list(layout.table) if layout is not None else None
    everyone = comm.gather(mine, root=0)
    if rank != 0:
        return
    share = cross_share(arm, world)
    per_rank_step = [sum(r["wire"]) / max(1, len(r["wire"])) for r in everyone]
    gaps = [b - a for a, b in zip(rec.times[10:], rec.times[11:], strict=False)]
    result = {
        "arm": arm, "world": world, "steps": trainer.global_step, "seed": seed,
        "final_loss": round(ttq_task.held_out_loss(module.net, held), 4),
        "marks": {}, "seconds": round(seconds, 1), "step_ms": round(1e3 * sum(gaps) / max(1, len(gaps)), 1),
        "wire_bytes_per_step_by_rank": per_rank_step,
        "bytes_out_per_step": sum(per_rank_step),
        "cross_share": share,
        "cross_bytes_per_step": share * sum(per_rank_step),
        "inner_bytes_per_step": sum(sum(r["inner"]) / max(1, len(r["inner"])) for r in everyone),
        "end_bytes": sum(r["end_bytes"] for r in everyone),
        "exchange_steps": sum(1 for b in everyone[0]["wire"] if b > 0),
        "outer_steps": everyone[0]["stats"].get("outer_steps"),
        "replica_table": everyone[0]["table"],
        "stats_rank0": everyone[0]["stats"],
    }
    with torch.no_grad():
        for step, weights in sorted(rec.snapshots.items()):
            for p, w in zip(module.parameters(), weights, strict=True):
                p.copy_(w)
            result["marks"][str(step)] = round(ttq_task.held_out_loss(module.net, held), 4)
    out.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------- driver ---
def run_arm(label: str, spec: str, ranks: int, steps: int, marks: list[int], seed: int, timeout: float) -> dict:
    out = RESULTS / f".hybrid_levels_{label}_{seed}.json"
    out.unlink(missing_ok=True)
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(Path(__file__).resolve()), "--worker", spec,
           "--steps", str(steps), "--seed", str(seed), "--worker-out", str(out), "--marks", *map(str, marks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    begin = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - begin
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"label": label, "arm": spec, "seed": seed, "error": f"rc={proc.returncode}", "log_tail": tail,
                "wall_s": round(wall, 1)}
    result = json.loads(out.read_text())
    out.unlink()
    return {"label": label, **result, "wall_s": round(wall, 1)}


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def save(path: Path, runs: list[dict], meta: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


def summarize(runs: list[dict], order: list[str]) -> dict[str, dict]:
    """Per label: the seeds' losses, their mean, and the bytes (the same for every seed)."""
    rows = {}
    for label in order:
        ok = sorted((r for r in runs if r.get("label") == label and "error" not in r), key=lambda r: r["seed"])
        failed = [r for r in runs if r.get("label") == label and "error" in r]
        if not ok and not failed:
            continue
        row = {"arm": (ok or failed)[0]["arm"], "seeds": [r["seed"] for r in ok], "failed": [r["seed"] for r in failed]}
        if ok:
            row["final"] = [r["final_loss"] for r in ok]
            row["final_mean"] = sum(row["final"]) / len(ok)
            steps = sorted({int(s) for r in ok for s in r["marks"]})
            row["marks"] = {s: sum(r["marks"][str(s)] for r in ok) / len(ok) for s in steps
                            if all(str(s) in r["marks"] for r in ok)}
            for key in ("cross_bytes_per_step", "bytes_out_per_step", "inner_bytes_per_step", "end_bytes"):
                row[key] = sum(r[key] for r in ok) / len(ok)
            row["outer_steps"] = ok[0].get("outer_steps")
            row["exchange_steps"] = ok[0].get("exchange_steps")
            row["wall_s"] = sum(r["wall_s"] for r in ok) / len(ok)
        rows[label] = row
    return rows


def table(rows: dict[str, dict], steps: int) -> str:
    """One markdown table: loss (mean, then each seed), bytes across per step, their ratio to flat int4."""
    asa = rows.get("asa", {}).get("final_mean")
    flat = rows.get("flat_int4", {}).get("cross_bytes_per_step")
    lines = [f"| arm | held-out loss at step {steps}: mean (seeds) | vs `mpi_asa` | bytes across the slow link "
             "per step (all ranks) | vs flat int4 | bytes out per step, all ranks (all links) | wall s per run |",
             "|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        if "final" not in row:
            lines.append(f"| `{row['arm']}` | failed (seeds {row['failed']}) | | | | | |")
            continue
        seeds = ", ".join(f"{v:.4f}" for v in row["final"])
        vs_asa = f"{100 * (row['final_mean'] / asa - 1):+.2f}%" if asa else ""
        cross = row["cross_bytes_per_step"]
        vs_flat = f"{cross / flat:.3f}x" if flat and label != "local" else ""
        ranks = 1 if label == "local" else WORLD
        name = f"`{row['arm']}`" + (" (1 process)" if ranks == 1 else "")
        lines.append(f"| {name} | {row['final_mean']:.4f} ({seeds}) | {vs_asa} | {cross / 1e3:,.1f} kB | {vs_flat} | "
                     f"{row['bytes_out_per_step'] / 1e3:,.1f} kB | {row['wall_s']:.0f} |")
    return "\n".join(lines)


def marks_table(rows: dict[str, dict]) -> str:
    """Held-out loss of rank 0's own weights at the marks (mean over seeds), and the ratio to ``mpi_asa``'s."""
    asa = rows.get("asa", {}).get("marks", {})
    steps = sorted({s for row in rows.values() for s in row.get("marks", {})})
    lines = ["| arm (rank 0's weights) | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for row in rows.values():
        if not row.get("marks"):
            continue
        cells = []
        for s in steps:
            v = row["marks"].get(s)
            cell = "" if v is None else f"{v:.3f}"
            if v is not None and s in asa and row is not rows.get("asa"):
                cell += f" ({100 * (v / asa[s] - 1):+.1f}%)"
            cells.append(cell)
        lines.append(f"| `{row['arm']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[str, dict], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for style, row in zip(["-", "--", ":", "-", "-."], rows.values(), strict=False):
        if not row.get("marks"):
            continue
        xs = sorted(row["marks"])
        label = f"{row['arm']} ({len(row['seeds'])} seeds)"
        ax.plot(xs, [row["marks"][x] for x in xs], style, marker="o", ms=3, label=label)
        ax.plot([steps], [row["final_mean"]], marker="x", color=ax.lines[-1].get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (nats/byte), mean over seeds")
    ax.set_title("4 ranks as 2 hosts x 2: rank 0's weights at each step; x: the weights fit leaves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps every arm trains (200: about 27 min here)")
    parser.add_argument("--period", type=int, default=20, help="H of every outer rule (4 fragments: one every H/4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=None, help="labels among " + ", ".join(arms(20)))
    parser.add_argument("--no-local", action="store_true", help="leave out the one-process reference")
    parser.add_argument("--marks", type=int, nargs="*", default=None, help="steps to score rank 0's weights at "
                        "(default every 25)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one mpiexec")
    parser.add_argument("--out", type=Path, default=RESULTS / "hybrid_levels.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "hybrid_levels.png")
    parser.add_argument("--report", action="store_true", help="table and plot from --out, nothing run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    marks = args.marks if args.marks is not None else list(range(25, args.steps + 1, 25))
    if args.worker:
        worker(args.worker, args.steps, marks, args.seed, args.worker_out)
        return 0
    catalog = arms(args.period)
    labels = args.arms or [k for k in catalog if not (args.no_local and k == "local")]
    runs = load(args.out)
    if not args.report:
        RESULTS.mkdir(parents=True, exist_ok=True)
        meta = {"steps": args.steps, "period": args.period, "seeds": args.seeds, "world": WORLD, "ranks_per_host": HOST,
                "marks": marks, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        begin = time.perf_counter()
        for seed in args.seeds:
            for label in labels:
                spec, ranks = catalog[label]
                runs = [r for r in runs if not (r.get("label") == label and r.get("seed") == seed)]
                result = run_arm(label, spec, ranks, args.steps, marks, seed, args.timeout)
                runs.append(result)
                msg = result.get("error") or f"loss {result['final_loss']:.4f}"
                print(f"seed {seed} {label} ({spec}): {msg}, {result['wall_s']:.0f} s", flush=True)
                if "error" in result:
                    print(result["log_tail"], flush=True)
                save(args.out, runs, meta)
        meta["wall_s"] = round(time.perf_counter() - begin, 1)
        meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(args.out, runs, meta)
    steps = args.steps
    rows = summarize([r for r in runs if r.get("steps", steps) == steps], [k for k in catalog if k in labels])
    print(table(rows, steps))
    print()
    print(marks_table(rows))
    if rows:
        plot(rows, args.plot, steps)
        print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
