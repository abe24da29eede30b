"""Run on 3 or 4 ranks: the point-to-point allreduce (lightning_mpi.comm.ring) against what one
process computes (tests/comm/test_ring.py).

Each case reduces every rank's own values (reproducible from the rank, so every rank also computes
the expected result itself) through ``Transport(ring=True)``: blocking (recursive doubling up to
1 MiB, the ring above), each algorithm on its own, two exchanges in flight on one communicator at
once (each waits on the other's messages in between: the tags must keep their steps apart), and
lengths below the number of ranks. Rank 0 writes, per case, the largest error
against the expected result, and whether every rank ended with the same bytes, to argv[1].
"""

import hashlib
import json
import sys

import torch
from mpi4py import MPI

from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.ring import doubling_allreduce_steps, ring_allreduce_steps
from lightning_mpi.comm.transport import Transport

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def values(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=generator, dtype=dtype)


def expected(numel: int, dtype: torch.dtype, seed: int, op: str) -> torch.Tensor:
    stack = torch.stack([values(r, numel, dtype, seed).double() for r in range(SIZE)])
    return {"sum": stack.sum(0), "prod": stack.prod(0), "max": stack.amax(0), "min": stack.amin(0)}[op]


def record(name: str, result: torch.Tensor, want: torch.Tensor, out: dict) -> None:
    digest = hashlib.sha256(result.numpy().tobytes()).hexdigest()
    digests = WORLD.allgather(digest)
    error = float((result.double() - want).abs().max()) if result.numel() else 0.0
    out[name] = {"error": max(WORLD.allgather(error)), "identical": len(set(digests)) == 1}


def main() -> None:
    transport = Transport(WORLD.Dup(), timeout=60.0, ring=True)
    out: dict = {"ring": transport.ring}
    seed = 0
    for numel in (1, SIZE - 1, 7, 1000, 12_345):
        for dtype in (torch.float32, torch.float64, torch.int64):
            for op in ("sum", "max", "min", "prod"):
                if op == "prod" and numel > 10:
                    continue  # products of a thousand values overflow
                seed += 1
                tensor = values(RANK, numel, dtype, seed)
                transport.allreduce_(tensor, op)
                record(f"{op}-{numel}-{str(dtype)[6:]}", tensor, expected(numel, dtype, seed, op), out)
    # each algorithm on its own, whatever the length (the transport picks by length)
    for name, steps in (("ring", ring_allreduce_steps), ("doubling", doubling_allreduce_steps)):
        for numel in (1, SIZE + 1, 1000):
            seed += 1
            tensor = values(RANK, numel, torch.float32, seed)
            scheduler = ExchangeScheduler(timeout=60.0, comm=transport.comm)
            scheduler.start(steps(transport.comm, tensor, "sum", 28_000 + seed))
            scheduler.wait_all()
            record(f"{name}-sum-{numel}-float32", tensor, expected(numel, torch.float32, seed, "sum"), out)
    # longer than DOUBLING_BYTES: the transport goes round the ring
    long = values(RANK, 300_007, torch.float32, 800)
    transport.allreduce_(long)
    record("sum-300007-float32", long, expected(300_007, torch.float32, 800, "sum"), out)
    # two in flight on one communicator, started in the same order everywhere and driven by
    # one scheduler: each rank finishes them at its own pace
    big, small = values(RANK, 100_003, torch.float32, 900), values(RANK, 5, torch.float32, 901)
    scheduler = ExchangeScheduler(timeout=60.0, comm=transport.comm)
    scheduler.start(transport.iallreduce_(big))
    scheduler.start(transport.iallreduce_(small))
    scheduler.wait_all()
    record("in-flight-big", big, expected(100_003, torch.float32, 900, "sum"), out)
    record("in-flight-small", small, expected(5, torch.float32, 901, "sum"), out)
    if RANK == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
