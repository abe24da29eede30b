"""Run on W ranks: every collective against numpy, for odd sizes and every dtype.

Each rank regenerates every rank's input from its seed, so it can compute the exact expected
result with numpy. Rank 0 writes {case: max abs error} as JSON to argv[1]; every rank also checks
that its result is bitwise identical to rank 0's.
"""
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.comm.codecs import BF16, FP16, FP32
from lightning_mpi.comm.collectives import ASAWorkspace, allreduce_mean_, asa_mean_steps
from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.transport import Transport

t = Transport(MPI.COMM_WORLD)
W, R = t.size, t.rank
SIZES = [1, 2, 7, 13, 1000, 4099]
out: dict[str, float] = {}
identical: list[str] = []


def data(rank, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)


def asa_mean_(transport, flat, codec):
    """The strategies' ASA exchange, driven to completion by their scheduler."""
    progress = ExchangeScheduler(timeout=60, rank=transport.rank, size=transport.size)
    progress.start(asa_mean_steps(transport, flat, codec, ASAWorkspace.for_buffer(flat, transport.size, codec)))
    progress.wait_all()


def same_everywhere(name, tensor):
    blobs = MPI.COMM_WORLD.allgather(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    if len(set(blobs)) != 1:
        identical.append(name)


for n in SIZES:
    # Raw transport: dtypes MPI moves (float16/bfloat16 travel as int16 words).
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        x = data(R, n).to(dtype) if dtype.is_floating_point else torch.arange(n, dtype=dtype) * (R + 1)
        ref = sum((data(r, n).to(dtype) if dtype.is_floating_point else torch.arange(n, dtype=dtype) * (r + 1)) for r in range(W))
        y = x.clone()
        t.allreduce_(y, "sum")
        out[f"allreduce_sum/{dtype}/{n}"] = float((y.double() - ref.double()).abs().max())
        y = x.clone()
        t.allreduce_(y, "max")
        refmax = np.max(np.stack([(data(r, n).to(dtype) if dtype.is_floating_point else torch.arange(n, dtype=dtype) * (r + 1)).numpy() for r in range(W)]), axis=0)
        out[f"allreduce_max/{dtype}/{n}"] = float(np.abs(y.numpy().astype(np.float64) - refmax).max())
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
        x = data(R, n).to(dtype)
        b = x.clone() if R == 0 else torch.zeros_like(x)
        t.broadcast_(b)
        out[f"bcast/{dtype}/{n}"] = float((b.double() - data(0, n).to(dtype).double()).abs().max())
        gathered = torch.empty(W, n, dtype=dtype)
        t.allgather(x.reshape(1, -1), gathered)
        ref = torch.stack([data(r, n).to(dtype) for r in range(W)])
        out[f"allgather/{dtype}/{n}"] = float((gathered.double() - ref.double()).abs().max())
        send = torch.stack([data(R, n, seed=j + 1).to(dtype) for j in range(W)])  # row j -> rank j
        recv = torch.empty_like(send)
        t.alltoall(send, recv)
        ref = torch.stack([data(i, n, seed=R + 1).to(dtype) for i in range(W)])
        out[f"alltoall/{dtype}/{n}"] = float((recv.double() - ref.double()).abs().max())

    # Averaging exchanges on a padded bucket, against the float64 numpy mean.
    for name, fn in (
        ("allreduce_mean", lambda f: allreduce_mean_(t, f)),
        ("asa_fp32", lambda f: asa_mean_(t, f, FP32)),
        ("asa_fp16", lambda f: asa_mean_(t, f, FP16)),
        ("asa_bf16", lambda f: asa_mean_(t, f, BF16)),
    ):
        for dtype in (torch.float32, torch.float64) if name in ("allreduce_mean", "asa_fp32") else (torch.float32,):
            p = data(R, n).to(dtype)
            (bucket,) = make_buckets([p], W)
            bucket.pack()
            fn(bucket.flat)
            bucket.unpack()
            ref = np.mean(np.stack([data(r, n).numpy() for r in range(W)]), axis=0)
            scale = float(np.abs(ref).max()) or 1.0
            out[f"{name}/{dtype}/{n}"] = float(np.abs(p.double().numpy() - ref).max() / scale)
            same_everywhere(f"{name}/{dtype}/{n}", p)

if R == 0:
    json.dump({"errors": out, "not_identical": identical, "world_size": W}, open(sys.argv[1], "w"))
elif identical:
    print("not identical on rank", R, identical)
