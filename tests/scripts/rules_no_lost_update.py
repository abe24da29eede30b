"""Run on W ranks: every rank commits K known deltas to a sharded center concurrently.

Rank r's k-th delta is (r + 1) * (k + 1) * ones + arange(n): all values are small integers, so
float32 sums are exact and the final center must equal initial + Σ exactly. Each commit also
ticks the server clock with Fetch_and_op; the clock must end at W·K. Rank 0 writes JSON to argv[1].
"""
import json
import sys
import time

import torch
from mpi4py import MPI

from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.window import Counters, ShardedVector

comm = MPI.COMM_WORLD
rank, W = comm.Get_rank(), comm.Get_size()
N, K = 6 * W * 50, 40

initial = torch.arange(N, dtype=torch.float32) % 7
progress = ProgressThread.probing(comm, 5e-4, "the no-lost-update check")
center = ShardedVector(comm, N)
clock = Counters(comm, 1)
center.init_local(initial)
comm.Barrier()
old = torch.empty(N)
ticks = []
for k in range(K):
    delta = (rank + 1) * (k + 1) * torch.ones(N) + torch.arange(N, dtype=torch.float32) % 3
    ticks.append(clock.fetch_add(0, 1))
    center.add(delta, old if k % 2 else None)
    if rank == 1 and k % 5 == 0:
        time.sleep(0.01)  # a busy rank: its shard must still take commits
comm.Barrier()
final = center.read(torch.empty(N))
expected = initial.clone()
for r in range(W):
    for k in range(K):
        expected += (r + 1) * (k + 1) * torch.ones(N) + torch.arange(N, dtype=torch.float32) % 3
all_ticks = comm.gather(ticks, root=0)
final_clock = int(clock.read()[0])
same = comm.allgather(final.tolist())
clock.free()
center.free()
progress.close()
if rank == 0:
    flat = sorted(t for ts in all_ticks for t in ts)
    json.dump(
        {
            "max_abs_err": float((final - expected).abs().max()),
            "ranks_agree": all(s == same[0] for s in same),
            "clock": final_clock,
            "ticks_unique": flat == list(range(W * K)),
            "thread_alive": progress.alive,
        },
        open(sys.argv[1], "w"),
    )
