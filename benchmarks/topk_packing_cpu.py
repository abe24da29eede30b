#!/usr/bin/env python3
"""CPU time of one top-k exchange, ``topk_packing="pairs"`` against ``"delta16"``, at the same bytes.

    flock /tmp/bench.lock python benchmarks/topk_packing_cpu.py              # 6.3M entries, 1%
    flock /tmp/bench.lock python benchmarks/topk_packing_cpu.py --numel 16500000 --ratio 0.01

On a world of one (``COMM_SELF``: no wire), one thread: ``topk_mean_steps`` with error feedback
selects, packs and scatter-adds; ``"delta16"`` carries about twice the entries in the same words.
Prints the median milliseconds of ``--steps`` exchanges (the first two left out), two rounds
interleaved. Timed: run it under the lock. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from mpi4py import MPI

from lightning_mpi.comm.sparse import TopKWorkspace, delta16_counts, delta16_fillers, topk_count, topk_mean_steps
from lightning_mpi.comm.transport import Transport


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=6_300_000)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    transport = Transport(MPI.COMM_SELF)
    n, pairs_k = args.numel, topk_count(args.numel, args.ratio)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for packing in ("pairs", "delta16"):
            k = pairs_k if packing == "pairs" else delta16_counts(n, 2 * pairs_k)
            words = 2 * k if packing == "pairs" else k + delta16_fillers(n)
            work = TopKWorkspace(k, 1, torch.device("cpu"), n).resize(k, words)
            residual = torch.zeros(n)
            times = []
            for _ in range(args.steps):
                flat = torch.randn(n, generator=gen)
                begin = time.perf_counter()
                for _ in topk_mean_steps(transport, flat, k, work, residual, packing=packing):
                    pass
                times.append(time.perf_counter() - begin)
            ms = 1e3 * statistics.median(times[2:])
            print(f"{packing:8s} entries {k:>9,} words {words:>9,} median {ms:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
