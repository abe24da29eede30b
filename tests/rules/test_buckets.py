"""BucketExchanger (lightning_mpi.rules.buckets) on 3 real ranks, against the mean numpy computes.

One launch checks every exchange and wire: Allreduce and ASA in fp32, ASA with fp16 and bf16 on
the wire (within one rounding of the sum), buckets cut into several pipelined segments (3 ranks
do not divide the buffers: padding), buckets that finish in any order with ``on_done`` called once
each, the byte count, and the release of every communicator.
"""
from __future__ import annotations

import json

import pytest

from tests.mpi_utils import run_mpi

SCRIPT = r"""
import json, sys
import numpy as np
import torch
from mpi4py import MPI
from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.buckets import BucketExchanger

transport = Transport(MPI.COMM_WORLD.Dup())
rank, world = transport.rank, transport.size
results = {}
for exchange, wire in [("allreduce", "fp32"), ("asa", "fp32"), ("asa", "fp16"), ("asa", "bf16")]:
    torch.manual_seed(100 + rank)
    tensors = [torch.randn(n) for n in (1000, 7, 20000, 333)]  # odd sizes: padding at W = 3
    originals = [t.clone() for t in tensors]
    ex = BucketExchanger(transport, exchange=exchange, wire=wire, segment_mb=0.02, progress_thread=True,
                         topology_aware=False)
    buckets = make_buckets(tensors, ex.pad_multiple, bucket_bytes=40_000)
    ex.prepare(buckets)
    done = []
    for bucket in buckets:
        bucket.pack()
        ex.start(bucket, on_done=lambda b: done.append(id(b)))
    ex.finish()
    for bucket in buckets:
        bucket.unpack()
    everyone = transport.allgather_object([t.numpy() for t in originals])
    mean = [np.mean([r[i] for r in everyone], axis=0) for i in range(len(tensors))]
    error = max(float(np.abs(t.numpy() - m).max() / (np.abs(m).max() + 1e-12)) for t, m in zip(tensors, mean))
    results[f"{exchange}/{wire}"] = {
        "relative_error": error,
        "buckets": len(buckets),
        "done_once_each": sorted(done) == sorted(id(b) for b in buckets),
        "segments": max(len(ex._slots[id(b)][1]) for b in buckets),
        "wire_bytes": ex.wire_bytes,
        "identical": len({t.numpy().tobytes() for t in transport.allgather_object(tensors[2])}) == 1,
    }
    ex.release(buckets)
    ex.close()
if rank == 0:
    with open(sys.argv[1], "w") as handle:
        json.dump(results, handle)
"""


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_every_exchange_and_wire_averages_pipelined_buckets_on_three_ranks(tmp_path):
    out, script = tmp_path / "exchanger.json", tmp_path / "exchanger.py"
    script.write_text(SCRIPT)
    run_mpi(3, [str(script), str(out)], timeout=110, cwd=tmp_path)
    results = json.loads(out.read_text())
    tolerance = {"allreduce/fp32": 1e-6, "asa/fp32": 1e-6, "asa/fp16": 2e-3, "asa/bf16": 2e-2}
    for name, r in results.items():
        assert r["relative_error"] < tolerance[name], (name, r)
        assert r["done_once_each"] and r["identical"], (name, r)
        assert r["buckets"] >= 2 and r["segments"] >= 2, (name, r)  # several buckets, pipelined
        assert r["wire_bytes"] > 0, name
    # 16-bit wires carry half the bytes of ASA in fp32
    assert results["asa/bf16"]["wire_bytes"] * 2 == pytest.approx(results["asa/fp32"]["wire_bytes"], rel=0.05)
