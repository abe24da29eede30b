"""The hard cases of healing, with mpi4py only (tests/comm/test_ulfm.py).

Usage: ``lightning-mpi --heal -n 4 ulfm_shrink.py OUT_DIR`` (Open MPI). A loop of
blocking Allreduces (each rank adds 1.0: a step's sum is the communicator's size) in which:

- step 4: ranks 2 and 3 die at once; the survivors heal to 2 ranks and respawn 2;
- step 8: replacement rank 3 dies, and replacement rank 2 dies *during* the heal (it takes part
  in the first shrink, then dies before the agreement), so the survivors shrink twice;
- then the survivors respawn 1, and the first process spawned for it dies before it joins, so
  :func:`respawn` spawns again; the loop ends on 3 ranks at step 12.

Each original rank that finishes writes ``OUT_DIR/out.<rank>.json``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from lightning_mpi.comm.respawn import join_parent, respawn
from lightning_mpi.comm.errors import ProcessFailed, failures_raised
from lightning_mpi.comm.ulfm import free, heal, mark_finished, revoke

OUT = Path(sys.argv[1])
STEPS = 12


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def mark(name: str) -> bool:
    """True the first time ``name`` is marked in this job (a file in OUT_DIR)."""
    path = OUT / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def main() -> None:
    if "--late" in sys.argv and mark("dies_before_join"):
        die()  # spawned, but gone before joining: respawn spawns again
    comm = join_parent()
    spawned = comm is not None
    if not spawned:
        comm = MPI.COMM_WORLD.Dup()
        step = 0
    else:
        step = int(comm.bcast(None, root=0))
    events, sums = [], {}
    while step < STEPS:
        rank = comm.Get_rank()
        if step == 4 and not spawned and rank in (2, 3):
            die()  # two ranks at once
        if step == 8 and spawned and rank == 3 and mark("replacement_3"):
            die()
        x = np.ones(1)
        try:
            with failures_raised(comm, "allreduce"):
                comm.Allreduce(MPI.IN_PLACE, x)
        except ProcessFailed as failure:
            if spawned and comm.Get_rank() == 2 and mark("dies_in_heal"):
                revoke(comm)
                comm.Shrink()  # the survivors' first shrink, with this rank in it ...
                die()  # ... which then dies before their agreement
            started = time.perf_counter()
            healed = heal(comm)
            free(comm)
            comm = healed.comm
            step = min(comm.allgather(step))  # redo the first step not every survivor completed
            event = {
                "step": step,
                "ranks": list(failure.ranks),
                "lost": list(healed.lost),
                "old_ranks": list(healed.old_ranks),
                "shrinks": healed.shrinks,
                "size": comm.Get_size(),
                "heal_seconds": time.perf_counter() - started,
            }
            n = 2 if step == 4 else 1
            late = step != 4  # the second respawn: its first new process dies before it joins
            spawned_run = respawn(comm, __file__, [str(OUT), *(["--late"] if late else [])], n, join_timeout=4)
            free(comm)
            comm = spawned_run.comm
            comm.bcast(step, root=0)
            event.update(
                new_ranks=list(spawned_run.new_ranks),
                attempts=spawned_run.attempts,
                size_after_respawn=comm.Get_size(),
                respawn_seconds=spawned_run.seconds,
            )
            events.append(event)
            continue
        sums[step] = (float(x[0]), comm.Get_size())
        step += 1
    if not spawned:
        (OUT / f"out.{comm.Get_rank()}.json").write_text(json.dumps({"events": events, "sums": sums}))
    mark_finished(comm)  # lightning-mpi --heal: finished, whatever mpirun reports or waits for
    free(comm)


if __name__ == "__main__":
    main()
