#!/usr/bin/env python3
"""Time per gradient exchange, side by side, shaped like Theano-MPI's Table 3.

Methods: MPI Allreduce, ASA, ASA-fp16, ASA-bf16 (lightning_mpi's transport, pipelined in
segments as the strategies run it) and torch.distributed gloo ``all_reduce`` (what Lightning's
``ddp`` uses on CPU). Sizes: the parameter counts of AlexNet, GoogLeNet and VGG-19 from the
Theano-MPI paper, and a sweep of fp32 buffer sizes. Settings: one host over shared memory, and
N simulated hosts on rate-limited links (``benchmarks/cluster.py``, needs root).

    python benchmarks/exchange.py                                  # shm + 2 hosts at 1 Gbit/s
    python benchmarks/exchange.py --settings shm:2 hosts:2:1gbit hosts:4:10gbit --sweep 1 4 16 64 256
    python benchmarks/exchange.py --quick                          # small sizes, a smoke run

Prints tables (median ms per exchange; ratio to Allreduce) and saves PNG plots and JSON under
``benchmarks/results/``. Medians of ``--iters`` timed runs after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {"AlexNet": 60_965_224, "GoogLeNet": 13_378_280, "VGG-19": 138_357_544}
METHODS = ["allreduce", "asa", "asa16", "asa_bf16", "gloo"]


# ------------------------------------------------------------------------------------ worker ----
def worker(sizes: list[int], methods: list[str], iters: int, out: str) -> None:
    """Runs on every rank under mpiexec; rank 0 writes {method: {numel: [seconds...]}}."""
    import torch
    from mpi4py import MPI

    from lightning_mpi.comm.buffers import padded_numel
    from lightning_mpi.rules.sync import BucketExchanger, SyncRule
    from lightning_mpi.comm.buffers import Bucket
    from lightning_mpi.comm.transport import Transport

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    transport = Transport(comm.Dup())
    results: dict[str, dict[int, list[float]]] = {}

    gloo = None
    if "gloo" in methods:
        import torch.distributed as dist

        host = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None)
        port = comm.bcast(29500 + (os.getpid() % 1000) if rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)
        gloo = dist

    for numel in sizes:
        flat = torch.randn(padded_numel(numel, world), generator=torch.Generator().manual_seed(rank))
        for method in methods:
            if method == "gloo":
                def run() -> None:
                    gloo.all_reduce(flat)
            else:
                exchange = {"allreduce": "allreduce"}.get(method, "asa")
                wire = {"asa16": "fp16", "asa_bf16": "bf16"}.get(method, "fp32")
                rule = SyncRule(exchange=exchange, wire=wire, bucket_mb=1e9)
                exchanger = BucketExchanger(transport, rule)
                bucket = Bucket([flat], [0], flat.numel(), flat)
                exchanger.prepare([bucket])

                def run(exchanger=exchanger, bucket=bucket) -> None:
                    exchanger(bucket)
            times = []
            for i in range(iters + 1):
                comm.Barrier()
                start = time.perf_counter()
                run()
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if i:  # the first run warms up buffers and connections
                    times.append(elapsed)
            results.setdefault(method, {})[numel] = times
        del flat
    if gloo is not None:
        gloo.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "results": results}))


# ------------------------------------------------------------------------------------ driver ----
def run_setting(setting: str, sizes: list[int], methods: list[str], iters: int, timeout: float) -> dict:
    """``shm:N`` (N ranks on this host) or ``hosts:N:RATE`` (N simulated hosts, one rank each)."""
    out = RESULTS / f"exchange_{setting.replace(':', '_')}.json"
    args = [sys.executable, __file__, "--worker", "--out", str(out), "--iters", str(iters),
            "--sizes", *map(str, sizes), "--methods", *methods]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    kind, *rest = setting.split(":")
    if kind == "shm":
        from lightning_mpi.launcher.checks import find_mpiexec

        env["GLOO_SOCKET_IFNAME"] = "lo"
        subprocess.run([find_mpiexec(), "-n", rest[0], *args], env=env, check=True, timeout=timeout)
    else:
        sys.path.insert(0, str(ROOT))
        from benchmarks.cluster import SimCluster, unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"skipping {setting}: {reason}")
            return {}
        n, rate = int(rest[0]), rest[1]
        with SimCluster(n, rate=rate) as cluster:
            res = cluster.run_mpi(args, ranks_per_host=1, env={"GLOO_SOCKET_IFNAME": cluster.iface, "PYTHONPATH": str(ROOT)},
                                  timeout=timeout)
            if res.returncode != 0:
                print(res.stdout[-2000:], res.stderr[-4000:])
                raise SystemExit(f"{setting} failed with exit code {res.returncode}")
    return json.loads(out.read_text())


def median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def print_table(title: str, rows: list[tuple[str, int]], data: dict, methods: list[str]) -> list[str]:
    lines = [f"\n{title}", "| " + " | ".join(["size", "params", *[f"{m} (ms)" for m in methods], *[f"{m}/allreduce" for m in methods if m != "allreduce"]]) + " |"]
    lines.append("|" + "---|" * (2 + 2 * len(methods) - 1))
    for label, numel in rows:
        cells = [label, f"{numel:,}"]
        med = {m: median_ms(data[m][str(numel)]) for m in methods if str(numel) in data.get(m, {})}
        cells += [f"{med[m]:.1f}" if m in med else "-" for m in methods]
        base = med.get("allreduce")
        cells += [f"{med[m] / base:.2f}" if base and m in med else "-" for m in methods if m != "allreduce"]
        lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    return lines


def plot(setting: str, sweep: list[int], data: dict, methods: list[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    mb = [4 * n / 2**20 for n in sweep]
    for m in methods:
        ys = [median_ms(data[m][str(n)]) for n in sweep if str(n) in data.get(m, {})]
        if len(ys) == len(sweep):
            ax.plot(mb, ys, marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fp32 gradient size (MB)")
    ax.set_ylabel("time per exchange (ms)")
    ax.set_title(f"exchange time, {setting}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"exchange_{setting.replace(':', '_')}.png", dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    parser.add_argument("--sizes", type=int, nargs="*", default=[])
    parser.add_argument("--settings", nargs="+", default=["shm:2", "hosts:2:1gbit"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sweep", type=float, nargs="*", default=[1, 4, 16, 64, 256], help="sweep sizes in MB of fp32")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of every path")
    args = parser.parse_args()
    if args.worker:
        worker(args.sizes, args.methods, args.iters, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    models = {m: MODELS[m] for m in args.models}
    sweep = [int(mb * 2**20 / 4) for mb in args.sweep]
    if args.quick:
        models, sweep, args.iters = {"tiny": 10_007}, [2**16, 2**18], 2
    sizes = sorted(set(models.values()) | set(sweep))
    report = [f"# exchange benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)"]
    for setting in args.settings:
        data = run_setting(setting, sizes, args.methods, args.iters, args.timeout)
        if not data:
            continue
        world = data["world"]
        title = f"{setting} ({world} ranks): median ms per exchange of fp32 gradients"
        report += print_table(title, [(k, v) for k, v in models.items()], data["results"], args.methods)
        report += print_table(f"{setting}: sweep", [(f"{4 * n / 2**20:g} MB", n) for n in sweep], data["results"], args.methods)
        plot(setting, sweep, data["results"], args.methods)
    (RESULTS / "exchange.md").write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
