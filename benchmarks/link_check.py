#!/usr/bin/env python3
"""Time an MPI Allreduce of a float32 buffer: does the traffic really cross the simulated link?

Run it across simulated hosts::

    python benchmarks/cluster.py run --hosts 2 --rate 1gbit -- python benchmarks/link_check.py

or plainly (shared memory) with ``mpiexec -n 2 python benchmarks/link_check.py``.
Rank 0 prints one line: ranks, hosts, size, median/min time and the algorithm bandwidth
(bytes / time). A ring/recursive Allreduce moves about 2·(p-1)/p of the buffer through each
rank's link in each direction, so at 1 Gbit/s 64 MB takes at least ~0.54 s on 2 ranks.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64.0, help="buffer size in MB (10^6 bytes), default 64")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median reported), default 5")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print a JSON line instead of text")
    args = p.parse_args(argv)

    comm = MPI.COMM_WORLD
    n = int(args.mb * 1e6) // 4
    send = np.full(n, comm.rank + 1, dtype=np.float32)
    recv = np.empty_like(send)
    hosts = comm.allgather(socket.gethostname())

    times = []
    for i in range(args.warmup + args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(send, recv, op=MPI.SUM)
        dt = time.perf_counter() - t0
        # The slowest rank defines the collective's time.
        dt = comm.allreduce(dt, op=MPI.MAX)
        if i >= args.warmup:
            times.append(dt)
    expected = comm.size * (comm.size + 1) / 2
    ok = bool(recv[0] == expected and recv[-1] == expected)
    ok = comm.allreduce(ok, op=MPI.LAND)

    if comm.rank == 0:
        med = statistics.median(times)
        nbytes = n * 4
        if args.json:
            import json

            print(json.dumps({"ranks": comm.size, "hosts": len(set(hosts)), "bytes": nbytes,
                              "median_s": med, "min_s": min(times), "times_s": times, "correct": ok}))
        else:
            print(f"allreduce ranks={comm.size} hosts={len(set(hosts))} size={nbytes / 1e6:.0f}MB "
                  f"median={med * 1e3:.0f}ms min={min(times) * 1e3:.0f}ms "
                  f"algbw={nbytes * 8 / med / 1e9:.2f}Gbit/s correct={ok}")
        sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
