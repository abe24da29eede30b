"""``heal="replace"`` with fewer spares than ranks lost (tests/strategies/test_heal.py).

Usage: ``lightning-mpi --heal -n 3 --spares 1 partial_let_in.py OUT_DIR``. A Fabric loop on
``SyncStrategy(heal="replace", min_ranks=1)``: at step KILL ranks 1 and 2 die together (after a
barrier, so that both reach it). Rank 0 heals alone, lets the one spare in (world size 2), and at the
next batch both spawn the rank still missing, which is let in later (world size 3). The loop runs
until STEPS and until the run is back at 3 ranks (the same decision on every rank: a let-in is
collective), at most LIMIT steps. Every rank that ends writes ``OUT_DIR/<who>.json`` (``rank0``,
``spare``, ``spawned``): its world size, step, weights, heal history, and the start size and
``min_ranks`` it holds.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from mpi4py import MPI

from lightning_mpi.fabric import SyncStrategy

STEPS, KILL, LIMIT = 6, 1, 4000
START = 3  # the training ranks launched

out = Path(sys.argv[1])
if os.environ.get("LIGHTNING_MPI_REPLACEMENT"):
    who = "spawned"
else:
    who = "spare" if MPI.COMM_WORLD.Get_rank() >= START else f"rank{MPI.COMM_WORLD.Get_rank()}"
strategy = SyncStrategy(heal="replace", min_ranks=1)  # a spare waits in here until it is let in
fabric = L.Fabric(strategy=strategy, accelerator="cpu")
fabric.launch()
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
state = {"model": model, "optimizer": opt, "step": 0}
while (state["step"] < STEPS or fabric.world_size < START) and state["step"] < LIMIT:
    fabric.strategy.let_in(state)
    step = state["step"]
    if step == KILL and fabric.world_size == START and who.startswith("rank"):
        fabric.barrier()
        if fabric.global_rank > 0:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    generator = torch.Generator().manual_seed(step * 10 + fabric.global_rank)
    x = torch.randn(8, 4, generator=generator)
    opt.zero_grad()
    fabric.backward(model(x).pow(2).mean())
    opt.step()
    state["step"] += 1
    time.sleep(0.02)  # the new process starts on the same cores
strategy.finish_training()
healing = strategy._core.healing
record = {
    "world_size": fabric.world_size,
    "step": state["step"],
    "weights": [p.detach().double().flatten().tolist() for p in net.parameters()],
    "history": healing.history,
    "start_size": healing.start_size,
    "min_ranks": healing.min_ranks,
}
(out / f"{who}.json").write_text(json.dumps(record))
