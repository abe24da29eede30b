"""Warm spares (lightning_mpi.comm.spare), with mpi4py only (tests/comm/test_ulfm.py).

Usage: ``lightning-mpi --heal -n 3 ulfm_spare.py OUT_DIR`` (Open MPI). A loop of blocking
Allreduces (each rank adds its rank + 1) in which:

- before step 0, the ranks spawn a warm spare and rank 0 waits until it is ready (it "imports" 1 s);
- step 4: rank 2 dies; the survivors heal to 2 ranks and let the spare in: 3 ranks again, the
  spare rank 2, at once (no new process is started);
- step 6: the ranks spawn a second spare, rank 0 waits until it is ready, and they dismiss it: it
  exits 0;
- step 8: the ranks spawn a third spare, which is SIGKILLed while it waits; rank 0 finds it dead
  (``Spare.ready`` raises) and the run goes on;
- the loop ends on 3 ranks at step 12.

Each finishing process writes ``OUT_DIR/out.<name>.json``; the dismissed spare writes
``dismissed.<pid>`` as it exits.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from lightning_mpi.comm.spare import SPARE_WORLD, SpareDismissed, let_in, spawn_spare, wait_to_be_let_in
from lightning_mpi.comm.ulfm import ProcessFailed, failures_raised, free, heal, mark_finished

OUT = Path(sys.argv[1])
STEPS = 12


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def ready_spare(comm):
    """Spawn a spare (collective); rank 0 waits until it is ready."""
    spare = spawn_spare(comm, __file__, [str(OUT)])
    assert spare is not None
    while spare.leader and not spare.ready():
        time.sleep(0.01)
    return spare


def as_spare() -> None:
    time.sleep(1.0)  # the imports a real script would make
    which = (OUT / "spares").read_text().strip() if (OUT / "spares").exists() else "0"
    (OUT / "spares").write_text(str(int(which) + 1))
    if which == "2":
        (OUT / f"doomed.{os.getpid()}").write_text("")  # rank 0 kills it while it waits
    try:
        comm = wait_to_be_let_in(SPARE_WORLD.pop())
    except SpareDismissed:
        (OUT / f"dismissed.{os.getpid()}").write_text(which)
        raise
    step = int(comm.bcast(None, root=0))
    loop(comm, step, {"spare": True, "which": which, "joined_at": step, "size_at_join": comm.Get_size()})


def loop(comm, step, out) -> None:
    sums, events = {}, []
    while step < STEPS:
        rank = comm.Get_rank()
        if step == 4 and rank == 2 and not out.get("spare"):
            die()
        if step == 6 and "second" not in out:
            spare = ready_spare(comm)
            spare.dismiss()  # every rank: the leader tells it, every rank frees the spare world
            out["second"] = "dismissed"
        if step == 8 and "third" not in out:
            spare = ready_spare(comm)
            if rank == 0:
                doomed = list(OUT.glob("doomed.*"))
                os.kill(int(doomed[0].suffix[1:]), signal.SIGKILL)
                try:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:
                        spare.ready()
                        time.sleep(0.05)
                    out["third"] = "not found dead"
                except ProcessFailed as failure:
                    out["third"] = f"found dead: {failure.where}"
            comm.Barrier()
            spare.close()
        x = np.full(1, float(rank + 1))
        try:
            with failures_raised(comm, "allreduce"):
                comm.Allreduce(MPI.IN_PLACE, x)
        except ProcessFailed:
            healed = heal(comm)
            free(comm)
            comm = healed.comm
            step = min(comm.allgather(step))
            started = time.perf_counter()
            grown = let_in(comm, out["held_spare"])
            assert grown is not None
            free(comm)
            comm = grown.comm
            comm.bcast(step, root=0)
            events.append({"step": step, "lost": list(healed.lost), "size": comm.Get_size(),
                           "new_ranks": list(grown.new_ranks), "let_in_seconds": time.perf_counter() - started})
            continue
        sums[step] = (float(x[0]), comm.Get_size())
        step += 1
    out.pop("held_spare", None)
    out.update(sums=sums, events=events, rank=comm.Get_rank())
    name = f"spare{out['which']}" if out.get("spare") else str(comm.Get_rank())
    (OUT / f"out.{name}.json").write_text(json.dumps(out))
    mark_finished(comm)
    free(comm)


def main() -> None:
    if SPARE_WORLD:
        as_spare()
        return
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    out = {"held_spare": ready_spare(comm)}
    comm.Barrier()
    loop(comm, 0, out)


if __name__ == "__main__":
    main()
