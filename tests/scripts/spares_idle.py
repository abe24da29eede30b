"""A Fabric loop launched with ``LIGHTNING_MPI_SPARES=1`` and nobody lost (tests/comm/test_spares.py).

Usage: ``mpiexec -n 3 python spares_idle.py OUT_DIR`` with ``LIGHTNING_MPI_SPARES=1``. The last rank
is a spare: it waits inside the strategy's construction and is dismissed at the end, so it never
gets past it. Every training rank writes ``OUT_DIR/rank{COMM_WORLD rank}.json``: the world size and
rank Fabric reports, and the sum of ones over the ranks (an ``all_reduce``).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from mpi4py import MPI

from lightning_mpi.fabric import SyncStrategy

out = Path(sys.argv[1])
world_rank = MPI.COMM_WORLD.Get_rank()
strategy = SyncStrategy()  # a spare stays in here until rank 0 dismisses it at exit
fabric = L.Fabric(strategy=strategy, accelerator="cpu")
fabric.launch()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for _ in range(3):
    opt.zero_grad()
    fabric.backward(model(torch.randn(8, 4)).pow(2).mean())
    opt.step()
ones = float(fabric.all_reduce(torch.tensor([1.0]), reduce_op="sum"))
strategy.finish_training()
record = {"world_size": fabric.world_size, "rank": fabric.global_rank, "ones": ones}
(out / f"rank{world_rank}.json").write_text(json.dumps(record))
