"""Serving a parameter-server shard: one-sided RMA + progress thread vs a service thread.

    mpiexec -n 2 python benchmarks/ps_serving.py [--mb 4] [--commits 20]

Rank 0 hosts a center of ``--mb`` MiB and computes on the main thread; rank 1 commits deltas to it
as fast as it can and times each commit (until the commit is complete at the origin). Two designs:

- ``one-sided`` (what :mod:`lightning_mpi.comm.window` does): ``Win.Allocate`` memory, rank 1 does
  ``Lock(SHARED)/Accumulate(SUM)/Unlock``; rank 0 runs a thread that calls ``Iprobe`` every 0.5 ms so
  MPICH progresses the RMA while the main thread computes.
- ``service``: rank 0 runs a thread that ``Recv``s each delta on a dup'd communicator and adds it
  into the center with numpy; rank 1 ``Send``s (rendezvous at this size: complete once received).

Host load on rank 0: ``python`` (a pure-Python loop: holds the GIL) and ``torch`` (matmuls: torch
releases the GIL). Prints median and p90 commit latency per design and load. The machine's other
load changes the numbers: quote them with it.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def run(design: str, load: str, n: int, commits: int) -> list[float]:
    dup = comm.Dup()
    lat: list[float] = []
    if design == "one-sided":
        win = MPI.Win.Allocate(n * 4 if rank == 0 else 0, 4, comm=dup)
        probe_comm = dup.Dup()
        stop_probe = threading.Event()

        def prog():
            while not stop_probe.is_set():
                probe_comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
                time.sleep(5e-4)

        t = threading.Thread(target=prog, daemon=True) if rank == 0 else None
    else:
        center = np.zeros(n, dtype=np.float32) if rank == 0 else None
        lock = threading.Lock()

        def serve():
            buf = np.empty(n, dtype=np.float32)
            for _ in range(commits):
                dup.Recv(buf, source=1, tag=11)
                with lock:
                    np.add(center, buf, out=center)

        t = threading.Thread(target=serve, daemon=True) if rank == 0 else None
    dup.Barrier()
    if rank == 0:
        t.start()
        # The host computes on its main thread, as in training: ~50 ms chunks without MPI calls,
        # one Test in between to learn that rank 1 is done.
        done = dup.Ibarrier()
        while not done.Test():
            host_work_chunk(load)
        if design == "one-sided":
            stop_probe.set()
        t.join()
    else:
        delta = np.ones(n, dtype=np.float32)
        for _ in range(commits):
            t0 = time.perf_counter()
            if design == "one-sided":
                win.Lock(0, MPI.LOCK_SHARED)
                win.Accumulate(delta, 0, op=MPI.SUM)
                win.Unlock(0)
            else:
                dup.Send(delta, dest=0, tag=11)
            lat.append(time.perf_counter() - t0)
        dup.Ibarrier().Wait()
    if design == "one-sided":
        dup.Barrier()
        win.Free()
        if rank == 0:
            probe_comm.Free()
    dup.Free()
    return lat


def host_work_chunk(kind: str) -> None:
    """About 50 ms of host work without any MPI call."""
    end = time.perf_counter() + 0.05
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        if kind == "python":
            s = 0
            for i in range(5000):
                s += i
        else:
            a = torch.tanh(a @ a.T / 256)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--commits", type=int, default=20)
    args = p.parse_args()
    n = int(args.mb * 2**20 / 4)
    torch.set_num_threads(1)
    if rank == 1:
        print(f"| design | host load | median ms | p90 ms |  ({args.mb:g} MiB commits, {args.commits} each)")
        print("|---|---|---|---|")
    for design in ("one-sided", "service"):
        for load in ("python", "torch"):
            lat = run(design, load, n, args.commits)
            if rank == 1:
                ms = np.array(lat) * 1e3
                print(f"| {design} | {load} | {np.median(ms):.1f} | {np.percentile(ms, 90):.1f} |", flush=True)


if __name__ == "__main__":
    main()
