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
    mpi_hybrid:group_size=2,period=H,wire='sparseloco'        (``hybrid_sparse``) two levels, the pieces
                                           across on SparseLoCo's wire (top-k of every 4096, 2-bit values)
    mpi_streaming_diloco:period=H,wire='sparseloco'           (``flat_sparse``) flat, SparseLoCo's wire

(the labels, for ``--arms``: ``hybrid``, ``flat_int4``, ``flat_fp32``, ``asa``, ``local``,
``hybrid_sparse``, ``flat_sparse``; every outer arm has the same period H, so all of them exchange
at the same steps, four fragments in turn, one every H/4 steps),

every one from the same seed (initial weights and training windows), for each seed of ``--seeds``,
one ``mpiexec -n 4`` per arm and seed (``mpiexec -n 1`` for ``local``) running this script in
worker mode (``--worker``), the way ``benchmarks/ttq_fixed_steps.py`` trains an arm::

    python benchmarks/hybrid_levels.py                          # 200 steps, period 20, seeds 0 1 2
    python benchmarks/hybrid_levels.py --steps 200 --seeds 0 --arms hybrid flat_int4
    python benchmarks/hybrid_levels.py --report                 # table and plot from the JSON
    python benchmarks/hybrid_levels.py --steps 200 --period 20 --seeds 0 1 2 --no-local \
        --arms hybrid flat_int4 hybrid_sparse flat_sparse --hosts 1gbit     # on 2 simulated hosts

``group_size=2`` makes the hosts for ``mpi_hybrid`` on one machine; the flat arms need none: what
is measured here (loss at equal steps, bytes) does not depend on where the ranks run or on time.
With ``--hosts RATE`` every 4-rank arm runs on two hosts of ``benchmarks/cluster.py``'s
``SimCluster(2, RATE)`` (root: network namespaces, veth, tc), ranks 0, 1 on the first and 2, 3 on
the second, and the bytes that cross between them are also measured (below); ``local`` runs as
without.

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

**Bytes over the link, measured** (``--hosts``). Each host's link is a veth pair; the bytes the
hosts' egress qdiscs sent, less those the switch namespace's own stack received (``mpiexec``'s
control traffic), are the bytes that went from one host to the other (``SimCluster.traffic()``
``between_hosts``): Ethernet, IP and TCP headers, TCP's ACKs and any retransmission included (each
TSO/GSO segment with its own headers; no preamble, FCS or inter-frame gap), and whatever MPICH
(ch4:ucx over TCP between hosts, ``UCX_TLS=tcp,self``) adds of its own (message headers,
rendezvous handshakes, the collectives' algorithms as MPICH picks them: no crossing share is
assumed). Traffic between the two ranks of one host goes over that host's loopback and is not
counted. The counters are read at three points where every rank stands still: each rank writes a
marker file (``--phases``, a folder the driver made) and waits, doing no MPI, until the driver has
seen all four markers, waited for the counters to stop moving (two readings 0.25 s apart equal; at
most 5 s: TCP's last ACKs) and read them:

- ``train_start``: at ``on_train_batch_start`` of the first step (after the strategy's set-up, the
  first broadcast of the weights and Lightning's start);
- ``train_end``: at ``on_train_batch_end`` of the last step, after the rank has completed the
  outer exchange the last step started (Streaming DiLoCo's ``overlap_steps = 1`` leaves one in
  flight: ``bound_rule.progress.wait_all()``, the wait that ``on_train_end`` starts with anyway; it
  changes nothing the run computes), so the window holds exactly the exchanges that the computed
  column counts, no more;
- ``fit_end``: right after ``fit`` returns (the end-of-training fold and Lightning's end).

``link_bytes_training`` = ``train_end − train_start`` (steps 1 … ``--steps``: what the rules sent
and MPI and TCP's overhead on it, and whatever Lightning itself exchanged between steps, e.g. its
stop decisions); ``link_bytes_per_step`` = that over the steps, beside the computed figure;
``link_bytes_end`` = ``fit_end − train_end`` (beside the computed ``end_bytes`` times the crossing
share); ``link_bytes_arm`` the whole ``mpiexec`` (start-up, the results' gather and the exit
included). Each arm and seed gets a fresh cluster. The hosts' names each rank saw are kept
(``hosts_by_rank``) with ``mpi_hybrid``'s replica table, to show that a replica is a host.

Writes ``benchmarks/results/hybrid_levels.json`` (every arm and seed; a rerun replaces its own
entries; with ``--hosts RATE``: ``hybrid_levels_hosts_RATE.json``, or ``--out``) and the plot beside
it (loss against step, mean over seeds), and prints the markdown tables. Not a test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
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
        "hybrid_sparse": (f"mpi_hybrid:group_size={HOST},period={period},wire='sparseloco'", WORLD),
        "flat_sparse": (f"mpi_streaming_diloco:period={period},wire='sparseloco'", WORLD),
    }


#: label -> the flat arm its measured bytes are compared with (same wire family)
FLAT_PEER = {"hybrid": "flat_int4", "hybrid_sparse": "flat_sparse"}


def cross_share(arm: str, world: int) -> float:
    """The share of a rank's ``wire_bytes`` that goes to the other host (module docstring)."""
    if world == 1:
        return 0.0
    if arm.startswith("mpi_hybrid"):
        return 1.0
    return (world - HOST) / (world - 1)


# ------------------------------------------------------------------------------------- worker ---
PHASES = ("train_start", "train_end", "fit_end")


def meet(phases: Path | None, phase: str, rank: int, timeout: float = 1800.0) -> None:
    """Tell the driver that this rank reached ``phase`` (a marker file) and wait, doing no MPI, until
    it has read the link counters (its ``<phase>.go`` file). Nothing without ``--phases``."""
    if phases is None:
        return
    tmp = phases / f".{phase}.{rank}.tmp"
    tmp.write_text(str(time.time()))
    os.replace(tmp, phases / f"{phase}.{rank}")
    go, deadline = phases / f"{phase}.go", time.monotonic() + timeout
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: the driver did not read the links at {phase} within {timeout:.0f} s")
        time.sleep(0.01)


def worker(arm: str, steps: int, marks: list[int], seed: int, out: Path, phases: Path | None = None) -> None:
    """Train ``arm`` for ``steps`` steps on every rank (as ``ttq_fixed_steps.fixed_steps``) and record
    every rank's bytes per step; rank 0 writes one JSON object to ``out``. With ``phases`` (a folder),
    every rank stops at the module docstring's three points until the driver has read the links."""
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
            self.met_start = False
            self.in_flight_at_end = None  # exchanges this rank completed before the train_end reading

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if not self.met_start:
                self.met_start = True
                meet(phases, "train_start", rank)

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
            if phases is not None and len(self.times) == steps:
                # the outer exchange the last step started (overlap_steps = 1) completes here, as
                # on_train_end's first wait would: its bytes belong to the training window
                progress = getattr(bound, "progress", None)
                self.in_flight_at_end = len(progress) if progress is not None else None
                if progress is not None and len(progress):
                    progress.wait_all()
                meet(phases, "train_end", rank)

    rec = Record()
    trainer = pl.Trainer(max_steps=steps, callbacks=[rec], **QUIET_TRAINER, **trainer_kwargs(arm))
    module = ttq_task.make_module(cfg)
    begin = time.perf_counter()
    trainer.fit(module, train_loader(train_text, cfg, 16))
    seconds = time.perf_counter() - begin
    meet(phases, "fit_end", rank)
    mine = {"wire": rec.wire, "inner": rec.inner, "end_bytes": 0.0, "stats": {}, "table": None,
            "host": socket.gethostname(), "in_flight_at_end": rec.in_flight_at_end,
            "bound": type(rec.bound).__name__ if rec.bound is not None else None}
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
        "hosts_by_rank": [r["host"] for r in everyone],
        "bound_rule": everyone[0]["bound"],
        "in_flight_at_end_by_rank": [r["in_flight_at_end"] for r in everyone],
    }
    with torch.no_grad():
        for step, weights in sorted(rec.snapshots.items()):
            for p, w in zip(module.parameters(), weights, strict=True):
                p.copy_(w)
            result["marks"][str(step)] = round(ttq_task.held_out_loss(module.net, held), 4)
    out.write_text(json.dumps(result))


# ------------------------------------------------------------------------------------- driver ---
#: seconds between the driver's looks at the phase markers; the links are quiet when two readings
#: ``QUIET_SECONDS`` apart agree, waited for at most ``SETTLE_LIMIT`` seconds
POLL_SECONDS, QUIET_SECONDS, SETTLE_LIMIT = 0.02, 0.25, 5.0


def watch_phases(folder: Path, ranks: int):
    """A :class:`~benchmarks.cluster.LinkReadings` watcher: at each of ``PHASES``, once every rank has
    reached it (its marker file in ``folder``) and the links have gone quiet, the counters, then the
    ``go`` file the ranks wait for (:func:`meet`)."""

    def watch(meter) -> None:
        for phase in PHASES:
            while not all((folder / f"{phase}.{r}").exists() for r in range(ranks)):
                if meter.wait(POLL_SECONDS):
                    return
            meter.take(phase, settled(meter.cluster))
            (folder / f"{phase}.go").write_text("")

    return watch


def settled(cluster) -> dict:
    """The counters once two readings ``QUIET_SECONDS`` apart agree (at most ``SETTLE_LIMIT`` s)."""
    last, deadline = cluster.traffic(), time.monotonic() + SETTLE_LIMIT
    while True:
        time.sleep(QUIET_SECONDS)
        now = cluster.traffic()
        if now == last or time.monotonic() > deadline:
            return {**now, "settled": now == last}
        last = now


def link_figures(meter, steps: int) -> dict:
    """The module docstring's ``link_*`` figures (None where a phase was not reached), per step of
    ``steps``."""
    training = meter.between("train_start", "train_end")
    return {
        "link_bytes_training": training,
        "link_bytes_per_step": training / max(1, steps) if training is not None else None,
        "link_bytes_end": meter.between("train_end", "fit_end"),
        "link_bytes_arm": meter.between("start", "end"),
        "mpiexec_bytes": meter.between("start", "end", "to_mpiexec"),
        "mpiexec_bytes_training": meter.between("train_start", "train_end", "to_mpiexec"),
        "link_settled": {p: meter.readings[p]["settled"] for p in PHASES if p in meter.readings},
    }


def run_arm(label: str, spec: str, ranks: int, steps: int, marks: list[int], seed: int, timeout: float,
            hosts: str | None = None) -> dict:
    """One ``mpiexec`` of the worker; with ``hosts`` (a rate) and several ranks, on a fresh
    ``SimCluster(WORLD // HOST, hosts)`` with the links measured (:func:`watch_phases`)."""
    out = RESULTS / f".hybrid_levels_{label}_{seed}.json"
    out.unlink(missing_ok=True)
    program = [sys.executable, str(Path(__file__).resolve()), "--worker", spec, "--steps", str(steps), "--seed",
               str(seed), "--worker-out", str(out), "--marks", *map(str, marks)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    link: dict = {}
    meter = None
    begin = time.perf_counter()
    try:
        if hosts and ranks > 1:
            from benchmarks.cluster import LinkReadings, SimCluster

            with tempfile.TemporaryDirectory(prefix="hybrid-levels-") as phases, \
                    SimCluster(ranks // HOST, rate=hosts) as cluster:
                env["GLOO_SOCKET_IFNAME"] = cluster.iface
                watch = watch_phases(Path(phases), ranks)
                with LinkReadings(cluster, watch, "hybrid-levels-phase-meter") as meter:
                    proc = cluster.run_mpi([*program, "--phases", phases], ranks_per_host=HOST, env=env,
                                           timeout=timeout, cwd=ROOT)
                link = {"hosts": hosts}
        else:
            proc = subprocess.run(["mpiexec", "-n", str(ranks), *program], cwd=ROOT, env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = "".join(x if isinstance(x, str) else (x or b"").decode(errors="replace")
                       for x in (exc.stdout, exc.stderr))[-3000:]
        return {"label": label, "arm": spec, "seed": seed, "error": f"timed out after {timeout:.0f} s",
                "log_tail": tail, "wall_s": round(time.perf_counter() - begin, 1), **link}
    wall = time.perf_counter() - begin
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr)[-3000:]
        figures = link_figures(meter, steps) if meter is not None else {}
        return {"label": label, "arm": spec, "seed": seed, "error": f"rc={proc.returncode}", "log_tail": tail,
                "wall_s": round(wall, 1), **link, **figures}
    result = json.loads(out.read_text())
    out.unlink()
    if meter is not None:  # per step of the steps the worker made
        link.update(link_figures(meter, result["steps"]))
    return {"label": label, **result, **link, "wall_s": round(wall, 1)}


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
            row["end_cross"] = sum(r["end_bytes"] * r["cross_share"] for r in ok) / len(ok)
            for key in ("link_bytes_training", "link_bytes_per_step", "link_bytes_end", "link_bytes_arm",
                        "mpiexec_bytes", "mpiexec_bytes_training"):
                values = [r.get(key) for r in ok]
                row[key] = sum(values) / len(ok) if all(v is not None for v in values) else None
                row[key + "_by_seed"] = values
            row["hosts"] = ok[0].get("hosts")
            row["outer_steps"] = ok[0].get("outer_steps")
            row["exchange_steps"] = ok[0].get("exchange_steps")
            row["wall_s"] = sum(r["wall_s"] for r in ok) / len(ok)
        rows[label] = row
    return rows


def table(rows: dict[str, dict], steps: int) -> str:
    """One markdown table: loss (mean, then each seed), bytes across per step (computed, and measured on
    the links where the arm ran on simulated hosts), their ratios to the flat arms."""
    asa = rows.get("asa", {}).get("final_mean")
    flat = rows.get("flat_int4", {}).get("cross_bytes_per_step")
    lines = [f"| arm | held-out loss at step {steps}: mean (seeds) | vs `mpi_asa` | bytes across the slow link "
             "per step (all ranks), computed | vs flat int4 (computed) | bytes across per step, measured on the "
             "link (training) | measured / computed | vs its flat peer (measured) | bytes out per step, all ranks "
             "(all links) | wall s per run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        if "final" not in row:
            lines.append(f"| `{row['arm']}` | failed (seeds {row['failed']}) | | | | | | | | |")
            continue
        seeds = ", ".join(f"{v:.4f}" for v in row["final"])
        vs_asa = f"{100 * (row['final_mean'] / asa - 1):+.2f}%" if asa else ""
        cross = row["cross_bytes_per_step"]
        vs_flat = f"{cross / flat:.3f}x" if flat and label != "local" else ""
        measured = row.get("link_bytes_per_step")
        link = f"{measured / 1e3:,.1f} kB" if measured is not None else ""
        over = f"{measured / cross:.3f}" if measured is not None and cross else ""
        peer = rows.get(FLAT_PEER.get(label, ""), {}).get("link_bytes_per_step")
        vs_peer = (f"{measured / peer:.3f}x (/ {FLAT_PEER[label]})"
                   if measured is not None and peer else "")
        ranks = 1 if label == "local" else WORLD
        name = f"`{row['arm']}`" + (" (1 process)" if ranks == 1 else "")
        lines.append(f"| {name} | {row['final_mean']:.4f} ({seeds}) | {vs_asa} | {cross / 1e3:,.1f} kB | {vs_flat} | "
                     f"{link} | {over} | {vs_peer} | {row['bytes_out_per_step'] / 1e3:,.1f} kB | "
                     f"{row['wall_s']:.0f} |")
    return "\n".join(lines)


def link_table(rows: dict[str, dict]) -> str:
    """Where arms ran on simulated hosts: the measured link bytes in full (mean over seeds, then each
    seed), beside the computed ones, and the two-level/flat ratios."""
    measured = {k: r for k, r in rows.items() if r.get("link_bytes_training") is not None}
    if not measured:
        return ""
    lines = ["| arm | link bytes, training (seeds) | per step | computed per step | end of fit: measured | "
             "end: computed (x share) | whole mpiexec | to mpiexec (whole; training) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in measured.values():
        seeds = ", ".join(f"{v / 1e6:,.2f}" for v in row["link_bytes_training_by_seed"])
        lines.append(f"| `{row['arm']}` | {row['link_bytes_training'] / 1e6:,.2f} MB ({seeds}) | "
                     f"{row['link_bytes_per_step'] / 1e3:,.1f} kB | {row['cross_bytes_per_step'] / 1e3:,.1f} kB | "
                     f"{row['link_bytes_end'] / 1e3:,.1f} kB | {row['end_cross'] / 1e3:,.1f} kB | "
                     f"{row['link_bytes_arm'] / 1e6:,.2f} MB | {row['mpiexec_bytes'] / 1e3:,.1f} kB; "
                     f"{row['mpiexec_bytes_training'] / 1e3:,.1f} kB |")
    hosts = {r.get("hosts") for r in measured.values()}
    lines.append("")
    lines.append(f"Links: {', '.join(sorted(map(str, hosts)))}, 2 hosts x 2 ranks.")
    for label, flat in FLAT_PEER.items():
        if label in measured and flat in measured:
            a, b = measured[label], measured[flat]
            ratio = a["link_bytes_per_step"] / b["link_bytes_per_step"]
            lines.append(f"- `{a['arm']}` / `{b['arm']}`: measured {ratio:.3f} "
                         f"(computed {a['cross_bytes_per_step'] / b['cross_bytes_per_step']:.3f})")
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
    for style, row in zip(itertools.cycle(["-", "--", ":", "-", "-.", "--", ":"]), rows.values()):
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
    parser.add_argument("--hosts", metavar="RATE", default=None, help="run every 4-rank arm on 2 simulated hosts "
                        "(benchmarks/cluster.py, root) with links of RATE (tc units: 1gbit, 100mbit) and measure "
                        "the bytes between them")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default "
                        "benchmarks/results/hybrid_levels.json; with --hosts RATE hybrid_levels_hosts_RATE.json)")
    parser.add_argument("--plot", type=Path, default=None, help="plot (default: --out with .png)")
    parser.add_argument("--report", action="store_true", help="table and plot from --out, nothing run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--phases", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    marks = args.marks if args.marks is not None else list(range(25, args.steps + 1, 25))
    if args.worker:
        worker(args.worker, args.steps, marks, args.seed, args.worker_out, args.phases)
        return 0
    if args.out is None:
        args.out = RESULTS / (f"hybrid_levels_hosts_{args.hosts}.json" if args.hosts else "hybrid_levels.json")
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    if args.hosts and not args.report:
        from benchmarks.cluster import _rate_bits, unavailable_reason

        _rate_bits(args.hosts)  # a bad rate fails here, not in every arm
        reason = unavailable_reason()
        if reason:
            parser.error(f"--hosts: {reason}")
    catalog = arms(args.period)
    labels = args.arms or [k for k in catalog if not (args.no_local and k == "local")]
    runs = load(args.out)
    if not args.report:
        RESULTS.mkdir(parents=True, exist_ok=True)
        meta = {"steps": args.steps, "period": args.period, "seeds": args.seeds, "world": WORLD, "ranks_per_host": HOST,
                "hosts": args.hosts, "marks": marks, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)}
        begin = time.perf_counter()
        for seed in args.seeds:
            for label in labels:
                spec, ranks = catalog[label]
                runs = [r for r in runs if not (r.get("label") == label and r.get("seed") == seed)]
                result = run_arm(label, spec, ranks, args.steps, marks, seed, args.timeout, args.hosts)
                runs.append(result)
                msg = result.get("error") or f"loss {result['final_loss']:.4f}"
                if result.get("link_bytes_per_step") is not None:
                    msg += (f", link {result['link_bytes_per_step'] / 1e3:,.1f} kB/step measured "
                            f"({result.get('cross_bytes_per_step', 0) / 1e3:,.1f} computed)")
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
    links = link_table(rows)
    if links:
        print(links)
        print()
    print(marks_table(rows))
    if any("final" in row for row in rows.values()):
        plot(rows, args.plot, steps)
        print(f"wrote {args.plot}" if args.report else f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
