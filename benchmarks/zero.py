"""ZeRO on ASA against plain ASA and torch.distributed's peers: memory, speed, capacity, checkpoints.

    OMP_NUM_THREADS=1 python benchmarks/zero.py                       # all sections, 2 ranks
    OMP_NUM_THREADS=1 python benchmarks/zero.py --sections capacity --worlds 2 4 --cap-mib 1200

Every arm runs as its own ``mpiexec`` job (``benchmarks/zero_worker.py``), so each peak RSS is that
run's alone; ranks share this machine's memory (MPICH's shared-memory transport). Adam, an MLP of
``--depth`` square layers ``--width`` wide, ``--batch`` rows per rank. Sections:

- ``side``: side by side at one size, ``--repeats`` rounds with the arms in turn: peak RSS per rank
  (and above the RSS once the model is built: what training adds), the optimizer state per rank,
  samples/s. Arms: ``ddp`` and ``ddp_zero`` (``DistributedDataParallel`` on gloo, with the full Adam /
  ``ZeroRedundancyOptimizer``), ``asa``/``asa_bf16`` (``SyncRule``) and ``zero``/``zero_bf16``
  (``ZeroRule``), the rules driven directly as the strategies drive them.
- ``capacity``: the widest MLP (of ``--depth`` layers) whose peak RSS stays under ``--cap-mib`` per
  rank, for ``ddp``, ``ddp_zero``, ``asa`` and ``zero``, at each of ``--worlds``. Peak RSS is about
  linear in the parameter count: two probe widths give a line, the width where it meets the cap
  (a multiple of 64) is run, and secant steps through the two largest runs refine it
  (``--search-runs``). A run fits when the kernel's peak RSS of every rank stays under the cap
  (measured after the fact, which is what a hard RSS limit would enforce).
- ``checkpoint``: time to save and load the training state: Lightning's rank-0 save of ``asa``'s
  replicated state and of ``ddp_zero``'s (consolidated onto rank 0 first, as Lightning's
  ``Strategy.optimizer_state`` does), against ``zero``'s sharded save (one file per rank) and an
  MPI-IO variant (one shared file, ``Write_at_all``) that decided the format. Files go to
  ``--checkpoint-dir``; loads read what was just written (the page cache is warm: it measures
  deserialisation and copying, not the disk).

- ``lightning``: the same under ``Trainer.fit`` (``benchmarks/zero_lightning_worker.py``): ``ddp``
  (gloo), ``ddp`` with ``ZeroRedundancyOptimizer`` from ``configure_optimizers``, ``mpi_asa``,
  ``mpi_zero``, ``mpi_zero_bf16``, each of ``--settings`` (``shm:W``: W ranks on this machine;
  ``hosts:N:RATE``: one rank on each of N simulated hosts joined by RATE links,
  ``benchmarks/cluster.py``, needs root), ``--repeats`` rounds with the arms in turn.
- ``lcheckpoint``: ``trainer.save_checkpoint`` and loading it back under the Trainer at each of
  ``--worlds``: Lightning's rank-0 save (``mpi_asa``; ``ddp`` + ``ZeroRedundancyOptimizer``, which
  consolidates onto rank 0 first) against ``mpi_zero``'s sharded directory.

A table goes to stdout; ``benchmarks/results/zero.json`` and ``zero.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
WORKER = HERE / "zero_worker.py"
LIGHTNING_WORKER = HERE / "zero_lightning_worker.py"
sys.path.insert(0, str(REPO))

#: arm -> what it is
ARMS = {
    "ddp": "DDP (gloo) + Adam",
    "ddp_zero": "DDP (gloo) + ZeroRedundancyOptimizer(Adam)",
    "asa": "SyncRule(asa) + Adam",
    "asa_bf16": "SyncRule(asa, bf16 wire) + Adam",
    "zero": "ZeroRule + sharded Adam",
    "zero_bf16": "ZeroRule(bf16 wire) + sharded Adam",
}
CAPACITY_ARMS = ("ddp", "ddp_zero", "asa", "zero")
#: the Lightning arms (zero_lightning_worker.py): Trainer strategies with Adam
LIGHTNING_ARMS = {
    "L_ddp": "ddp (gloo) + Adam",
    "L_ddp_zero": "ddp (gloo) + ZeroRedundancyOptimizer(Adam)",
    "L_mpi_asa": "mpi_asa + Adam",
    "L_mpi_zero": "mpi_zero + Adam (sharded)",
    "L_mpi_zero_bf16": "mpi_zero_bf16 + Adam (sharded)",
}


def run_arm(arm: str, world: int, width: int, depth: int, batch: int, steps: int, warmup: int = 2,
            checkpoint_dir: str | None = None, timeout: float = 900, cluster=None) -> dict:
    """One ``mpiexec`` job of ``zero_worker.py`` (``zero_lightning_worker.py`` for an ``L_`` arm),
    on this machine or one rank per host of ``cluster``; its JSON, or ``{"error": ...}``."""
    from tests.mpi_utils import mpi_env, mpiexec_path

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        worker = LIGHTNING_WORKER if arm.startswith("L_") else WORKER
        job = [sys.executable, str(worker), "--arm", arm, "--width", str(width), "--depth", str(depth),
               "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        if checkpoint_dir:
            job += ["--checkpoint-dir", checkpoint_dir]
        try:
            if cluster is not None:
                extra = {"GLOO_SOCKET_IFNAME": cluster.iface, "PYTHONWARNINGS": "ignore"}
                proc = cluster.run_mpi(job, env=extra, timeout=timeout)
            else:
                env = dict(mpi_env(), GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
                proc = subprocess.run([mpiexec_path(), "-n", str(world), *job], capture_output=True, text=True,
                                      timeout=timeout, env=env, start_new_session=True)
        except subprocess.TimeoutExpired:
            return {"arm": arm, "error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"arm": arm, "error": f"exit {proc.returncode}: {proc.stderr[-600:]}"}
        return json.loads(out.read_text())


# --- sections -----------------------------------------------------------------------------------
def side_by_side(args: argparse.Namespace) -> list[dict]:
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_ in range(args.repeats):
        order = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            result = run_arm(arm, 2, args.width, args.depth, args.batch, args.steps)
            print(f"  side {arm} round {round_}: {_brief(result)}", flush=True)
            runs[arm].append(result)
    rows = []
    for arm, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append({"arm": arm, "error": results[-1].get("error")})
            continue
        rows.append({
            "arm": arm, "params": ok[0]["params"], "runs": len(ok),
            "peak_rss_mib": statistics.median(max(r["peak_rss_mib"]) for r in ok),
            "above_model_mib": statistics.median(_above_model(r) for r in ok),
            "optimizer_state_mib": statistics.median(max(r["optimizer_state_mib"]) for r in ok),
            "samples_per_second": statistics.median(r["samples_per_second"] for r in ok),
        })
    return rows


def lightning(args: argparse.Namespace) -> list[dict]:
    """The Lightning arms side by side in each setting (``shm:W`` or ``hosts:N:RATE``)."""
    rows = []
    for setting in args.settings:
        kind, *rest = setting.split(":")
        if kind == "hosts":
            from benchmarks.cluster import SimCluster

            with SimCluster(int(rest[0]), rate=rest[1]) as cluster:
                rows += _lightning_rounds(args, setting, int(rest[0]), cluster)
        else:
            rows += _lightning_rounds(args, setting, int(rest[0]), None)
    return rows


def _lightning_rounds(args: argparse.Namespace, setting: str, world: int, cluster) -> list[dict]:
    runs: dict[str, list[dict]] = {arm: [] for arm in LIGHTNING_ARMS}
    # On shared memory, the first round also times trainer.save_checkpoint and its load at the end
    # of training (after the memory and speed are taken): rank-0 saves and sharded ones side by side.
    directory = None if cluster is not None else Path(tempfile.mkdtemp(prefix="zero_bench_", dir=REPO / "benchmarks"))
    for round_ in range(args.repeats):
        for arm in list(LIGHTNING_ARMS) if round_ % 2 == 0 else list(reversed(LIGHTNING_ARMS)):
            where = str(directory) if directory is not None and round_ == 0 else None
            result = run_arm(arm, world, args.width, args.depth, args.batch, args.steps, cluster=cluster,
                             checkpoint_dir=where)
            if where:
                shutil.rmtree(directory / arm, ignore_errors=True)
            print(f"  lightning {setting} {arm} round {round_}: {_brief(result)}", flush=True)
            runs[arm].append(result)
    rows = []
    for arm, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append({"setting": setting, "arm": arm, "error": results[-1].get("error")})
            continue
        rows.append({
            "setting": setting, "arm": arm, "params": ok[0]["params"], "runs": len(ok),
            "peak_rss_mib": statistics.median(max(r["peak_rss_mib"]) for r in ok),
            "above_model_mib": statistics.median(_above_model(r) for r in ok),
            "optimizer_state_mib": statistics.median(max(r["optimizer_state_mib"]) for r in ok),
            "samples_per_second": statistics.median(r["samples_per_second"] for r in ok),
            "all_samples_per_second": [r["samples_per_second"] for r in ok],
            "checkpoint_seconds": next((r["checkpoint_seconds"] for r in ok if "checkpoint_seconds" in r), None),
        })
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _above_model(result: dict) -> float:
    """The most any rank's peak RSS rose above its RSS once the model was built."""
    return max(p - m for p, m in zip(result["peak_rss_mib"], result["rss_model_mib"], strict=True))


def lightning_checkpoints(args: argparse.Namespace) -> list[dict]:
    directory = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="zero_bench_", dir=REPO / "benchmarks"))
    rows = []
    try:
        for world in args.worlds:
            for arm in ("L_mpi_asa", "L_ddp_zero", "L_mpi_zero"):
                result = run_arm(arm, world, args.width, args.depth, args.batch, steps=1, warmup=1,
                                 checkpoint_dir=str(directory / f"w{world}"))
                secs = result.get("checkpoint_seconds") or {}
                print(f"  lcheckpoint W={world} {arm}: {secs or result.get('error')}", flush=True)
                rows.append({"arm": arm, "world_size": world, "save": secs.get("save"), "load": secs.get("load"),
                             "bytes": secs.get("bytes"), "error": result.get("error")})
                shutil.rmtree(directory / f"w{world}", ignore_errors=True)
    finally:
        if not args.checkpoint_dir:
            shutil.rmtree(directory, ignore_errors=True)
    return rows


def capacity(args: argparse.Namespace) -> list[dict]:
    rows = []
    for world in args.worlds:
        for arm in args.capacity_arms:
            probes = []
            for width in args.probe_widths:
                result = run_arm(arm, world, width, args.depth, args.batch, steps=2, warmup=1)
                print(f"  capacity W={world} {arm} probe {width}: {_brief(result)}", flush=True)
                if "error" not in result:
                    probes.append((result["params"], max(result["peak_rss_mib"])))
            if len(probes) < 2:
                rows.append({"arm": arm, "world_size": world, "error": "probe runs failed"})
                continue
            fitted, slope, fixed = search_width(arm, world, probes, args)
            rows.append({
                "arm": arm, "world_size": world, "cap_mib": args.cap_mib, "mib_per_mparam": slope * 1e6,
                "fixed_mib": fixed, "width": fitted["width"] if fitted else None,
                "params": fitted["params"] if fitted else None,
                "peak_rss_mib": max(fitted["peak_rss_mib"]) if fitted else None,
            })
    return rows


def search_width(arm: str, world: int, points: list[tuple[int, float]], args: argparse.Namespace):
    """The widest run under the cap: the width where the line through the two largest measured
    runs meets the cap, run, and again (secant steps, a multiple of 64, at most ``--search-runs``),
    between the widest run that fit and the narrowest that did not."""
    fitted, fits, fails = None, 0, None
    slope = fixed = 0.0
    for _ in range(args.search_runs):
        (p1, m1), (p2, m2) = sorted(points)[-2:]
        slope = max((m2 - m1) / (p2 - p1), 1e-9)  # RSS is noisy: never a flat or falling line
        fixed = m1 - slope * p1
        width = int(math.sqrt(max((args.cap_mib - fixed) / slope, 1) / args.depth)) // 64 * 64
        width = min(width, fails - 64) if fails else width
        # RSS is noisy: a flat secant through two close runs must not jump far past the widest run
        width = min(width, 2 * int(math.sqrt(max(p for p, _ in points) / args.depth)) // 64 * 64)
        if width <= fits:
            break
        result = run_arm(arm, world, width, args.depth, args.batch, steps=2, warmup=1)
        print(f"  capacity W={world} {arm} at {width}: {_brief(result)}", flush=True)
        if "error" in result:
            fails = width
            continue
        points.append((result["params"], max(result["peak_rss_mib"])))
        if max(result["peak_rss_mib"]) <= args.cap_mib:
            fitted, fits = result, width
        else:
            fails = width
        if fails and fits and fails - fits <= 64:
            break
    return fitted, slope, fixed


def checkpoints(args: argparse.Namespace) -> list[dict]:
    directory = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="zero_bench_", dir=REPO / "benchmarks"))
    rows = []
    try:
        for arm in ("asa", "ddp_zero", "zero"):
            result = run_arm(arm, 2, args.width, args.depth, args.batch, steps=1, warmup=1, checkpoint_dir=str(directory))
            print(f"  checkpoint {arm}: {result.get('checkpoint_seconds', result.get('error'))}", flush=True)
            rows.append({"arm": arm, **{k: result.get(k) for k in ("checkpoint_seconds", "checkpoint_bytes", "error")}})
    finally:
        if not args.checkpoint_dir:
            shutil.rmtree(directory, ignore_errors=True)
    return rows


def _brief(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error'][:200]}"
    return (f"{result['params'] / 1e6:.1f}M params, peak {max(result['peak_rss_mib']):.0f} MiB, "
            f"{result['samples_per_second']:.0f} samples/s")


# --- report -------------------------------------------------------------------------------------
def report(data: dict) -> str:
    lines = []
    if data.get("side"):
        base = next((r for r in data["side"] if r["arm"] == "asa" and "error" not in r), None)
        lines += ["| arm | peak RSS / rank (MiB) | above the model (MiB) | Adam state / rank (MiB) | samples/s | vs asa |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in data["side"]:
            if "error" in r:
                lines.append(f"| {r['arm']} | failed: {r['error'][:80]} | | | | |")
                continue
            rel = f"{r['samples_per_second'] / base['samples_per_second']:.2f}x" if base else ""
            lines.append(f"| {r['arm']} | {r['peak_rss_mib']:.0f} | {r['above_model_mib']:.0f} | "
                         f"{r['optimizer_state_mib']:.1f} | {r['samples_per_second']:.0f} | {rel} |")
    if data.get("lightning"):
        lines += ["", "| setting | arm | peak RSS / rank (MiB) | above the model (MiB) | Adam state / rank (MiB) | "
                  "samples/s | vs mpi_asa | vs ddp+ZeRO-opt |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in data["lightning"]:
            if "error" in r:
                lines.append(f"| {r['setting']} | {r['arm']} | failed: {r['error'][:80]} | | | | | |")
                continue
            peers = {x["arm"]: x for x in data["lightning"] if x["setting"] == r["setting"] and "error" not in x}
            rel = [f"{r['samples_per_second'] / peers[p]['samples_per_second']:.2f}x" if p in peers else ""
                   for p in ("L_mpi_asa", "L_ddp_zero")]
            lines.append(f"| {r['setting']} | {r['arm'].removeprefix('L_')} | {r['peak_rss_mib']:.0f} | "
                         f"{r['above_model_mib']:.0f} | {r['optimizer_state_mib']:.1f} | "
                         f"{r['samples_per_second']:.1f} | {rel[0]} | {rel[1]} |")
        timed_saves = [r for r in data["lightning"] if r.get("checkpoint_seconds")]
        if timed_saves:
            lines += ["", "| setting | arm (Trainer) | save (s) | load (s) | on disk (MiB) |", "|---|---|---:|---:|---:|"]
            for r in timed_saves:
                c = r["checkpoint_seconds"]
                lines.append(f"| {r['setting']} | {r['arm'].removeprefix('L_')} | {c['save']:.3f} | {c['load']:.3f} | "
                             f"{c['bytes'] / 2**20:.0f} |")
    if data.get("lcheckpoint"):
        lines += ["", "| W | arm (Trainer) | save (s) | load (s) | on disk (MiB) |", "|---:|---|---:|---:|---:|"]
        for r in data["lcheckpoint"]:
            if r.get("save") is None:
                lines.append(f"| {r['world_size']} | {r['arm']} | failed: {str(r.get('error'))[:80]} | | |")
                continue
            lines.append(f"| {r['world_size']} | {r['arm'].removeprefix('L_')} | {r['save']:.3f} | {r['load']:.3f} | "
                         f"{r['bytes'] / 2**20:.0f} |")
    if data.get("capacity"):
        lines += ["", "| W | arm | widest under the cap | parameters | peak RSS (MiB) | MiB per M params | vs ddp |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for r in data["capacity"]:
            ddp = next((x for x in data["capacity"] if x["arm"] == "ddp" and x["world_size"] == r["world_size"]), None)
            if r.get("params") is None:
                lines.append(f"| {r['world_size']} | {r['arm']} | {r.get('error', 'none fits')} | | | | |")
                continue
            rel = f"{r['params'] / ddp['params']:.2f}x" if ddp and ddp.get("params") else ""
            lines.append(f"| {r['world_size']} | {r['arm']} | {r['width']} | {r['params'] / 1e6:.1f}M | "
                         f"{r['peak_rss_mib']:.0f} | {r['mib_per_mparam']:.1f} | {rel} |")
    if data.get("checkpoint"):
        lines += ["", "| arm | save | seconds | load seconds | bytes on disk |", "|---|---|---:|---:|---:|"]
        for r in data["checkpoint"]:
            secs = r.get("checkpoint_seconds") or {}
            size = sum((r.get("checkpoint_bytes") or {}).values()) // max(1, len(r.get("checkpoint_bytes") or {1: 0}))
            for kind in ("rank0", "sharded", "mpiio"):
                if f"save_{kind}" in secs:
                    load = secs.get(f"load_{kind}")
                    lines.append(f"| {r['arm']} | {kind} | {secs[f'save_{kind}']:.3f} | "
                                 f"{f'{load:.3f}' if load is not None else '-'} | {size / 2**20:.0f} MiB |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    side = [r for r in data.get("side", []) if "error" not in r]
    if side:
        names = [r["arm"] for r in side]
        base = [r["peak_rss_mib"] - r["above_model_mib"] for r in side]
        axes[0].bar(names, base, color="#bbbbbb", label="process + model")
        axes[0].bar(names, [r["above_model_mib"] for r in side], bottom=base, color="#4477aa", label="training adds")
        axes[0].set_ylabel("peak RSS per rank (MiB)")
        axes[0].legend(fontsize=8)
        axes[1].bar(names, [r["samples_per_second"] for r in side], color="#ee6677")
        axes[1].set_ylabel("samples/s (2 ranks)")
        params = side[0]["params"] / 1e6
        for ax in axes[:2]:
            ax.set_title(f"MLP {params:.1f}M params, Adam, 2 ranks", fontsize=9)
            ax.tick_params(axis="x", labelsize=7, rotation=30)
    cap = [r for r in data.get("capacity", []) if r.get("params")]
    if cap:
        worlds = sorted({r["world_size"] for r in cap})
        for i, world in enumerate(worlds):
            rows = [r for r in cap if r["world_size"] == world]
            xs = [j + 0.8 * i / len(worlds) for j in range(len(rows))]
            axes[2].bar(xs, [r["params"] / 1e6 for r in rows], width=0.8 / len(worlds), label=f"W={world}")
            axes[2].set_xticks(range(len(rows)), [r["arm"] for r in rows], fontsize=8)
        axes[2].set_ylabel("largest model under the cap (M params)")
        axes[2].set_title(f"per-rank cap {cap[0]['cap_mib']:.0f} MiB RSS", fontsize=9)
        axes[2].legend(fontsize=8)
    ck = [r for r in data.get("checkpoint", []) if r.get("checkpoint_seconds")]
    if ck:
        labels, saves, loads = [], [], []
        for r in ck:
            for kind in ("rank0", "sharded", "mpiio"):
                if f"save_{kind}" in r["checkpoint_seconds"]:
                    labels.append(f"{r['arm']}\n{kind}")
                    saves.append(r["checkpoint_seconds"][f"save_{kind}"])
                    loads.append(r["checkpoint_seconds"].get(f"load_{kind}", 0.0))
        xs = range(len(labels))
        axes[3].bar([x - 0.2 for x in xs], saves, width=0.4, label="save")
        axes[3].bar([x + 0.2 for x in xs], loads, width=0.4, label="load")
        axes[3].set_xticks(list(xs), labels, fontsize=7)
        axes[3].set_ylabel("seconds (2 ranks)")
        axes[3].legend(fontsize=8)
    light = [r for r in data.get("lightning", []) if "error" not in r]
    if light:
        settings = list(dict.fromkeys(r["setting"] for r in light))
        arms = list(dict.fromkeys(r["arm"] for r in light))
        for i, setting in enumerate(settings):
            by_arm = {r["arm"]: r for r in light if r["setting"] == setting}
            xs = [j + 0.8 * i / len(settings) for j in range(len(arms))]
            axes[4].bar(xs, [by_arm[a]["samples_per_second"] if a in by_arm else 0 for a in arms],
                        width=0.8 / len(settings), label=setting)
        axes[4].set_xticks(range(len(arms)), [a.removeprefix("L_") for a in arms], fontsize=7, rotation=30)
        axes[4].set_ylabel("samples/s under the Trainer")
        axes[4].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merged(old: list[dict] | None, new: list[dict], key: str) -> list[dict]:
    """``new``, after the rows of ``old`` whose ``key`` (setting, world size) this run did not measure:
    sections can be run one setting at a time and still end in one table."""
    measured = {r.get(key) for r in new}
    return [r for r in old or [] if r.get(key) not in measured] + new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["side", "capacity", "checkpoint"],
                        choices=["side", "capacity", "checkpoint", "lightning", "lcheckpoint"])
    parser.add_argument("--settings", nargs="+", default=["shm:2", "hosts:2:1gbit"],
                        help="where the lightning section runs: shm:W, hosts:N:RATE")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--cap-mib", type=float, default=1200.0)
    parser.add_argument("--probe-widths", type=int, nargs=2, default=[1024, 2048])
    parser.add_argument("--capacity-arms", nargs="+", default=list(CAPACITY_ARMS), choices=CAPACITY_ARMS)
    parser.add_argument("--search-runs", type=int, default=4, help="runs per arm to find the widest under the cap")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: a temporary "
                        "directory under benchmarks/, on the repository's file system)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "zero.json"
    setup = {"width": args.width, "depth": args.depth, "batch": args.batch, "steps": args.steps,
             "repeats": args.repeats, "worlds": args.worlds, "settings": args.settings, "cap_mib": args.cap_mib,
             "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    runs = {"side": side_by_side, "capacity": capacity, "checkpoint": checkpoints, "lightning": lightning,
            "lcheckpoint": lightning_checkpoints}
    fresh = {section: runs[section](args) for section in args.sections}
    setup["load_average_end"] = os.getloadavg()
    # Read the earlier results only now: another section may have been written meanwhile.
    data = json.loads(path.read_text()) if path.exists() else {}
    data["setup"] = setup
    merge_keys = {"capacity": "world_size", "lightning": "setting", "lcheckpoint": "world_size"}
    for section, rows in fresh.items():  # the sections may come from separate runs: each keeps its own setup
        data.setdefault("setups", {})[section] = setup
        key = merge_keys.get(section)
        data[section] = merged(data.get(section), rows, key) if key else rows
    path.write_text(json.dumps(data, indent=1))
    print(report(data))
    plot(data, RESULTS / "zero.png")
    print(f"wrote {path} and {RESULTS / 'zero.png'}")


if __name__ == "__main__":
    main()
