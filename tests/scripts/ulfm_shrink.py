"""The hard cases of healing, with mpi4py only (tests/comm/test_ulfm.py).

Usage: ``lightning-mpi --heal -n 4 ulfm_shrink.py OUT_DIR`` (Open MPI). A loop of
blocking Allreduces (each rank adds 1.0: a step's sum is the communicator's size) in which:

- step 4: ranks 2 and 3 die at once; the survivors heal to 2 ranks and respawn 2;
- step 8: replacement rank 3 dies, and replacement rank 2 dies *during* the heal (it takes part
  in the first shrink, then dies before the agreement), so the survivors shrink twice;
- then the survivors respawn 1, and the first process spawned for it dies before it joins, so
  :func:`respawn` spawns again; the loop ends on 3 ranks at step 12;
- then the 3 start one more spawn in a thread (:class:`Growing`) and cancel it at once: it is
  given up on every rank, and the new process leaves with exit code 0.

The first spawn runs in a thread too (:class:`Growing`, on the host :func:`placement` picks,
through the MPI ``host`` info key), while the survivors keep calling collectives of their own.

Each original rank that finishes writes ``OUT_DIR/out.<rank>.json``.
"""

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from lightning_mpi.comm.respawn import JOINED, join_parent, placement, respawn
from lightning_mpi.comm.errors import ProcessFailed, failures_raised
from lightning_mpi.comm.healing import Growing
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
    comm = JOINED.pop() if JOINED else join_parent()  # a Growing's new process joined before the script
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
            if late:
                spawned_run = respawn(comm, __file__, [str(OUT), "--late"], n, join_timeout=4)
            else:  # in a thread, on the host placement() picks, while the survivors go on talking
                hosts = placement([socket.gethostname()] * comm.Get_size(), n)
                growing = Growing(comm, __file__, [str(OUT)], n, hosts=hosts)
                polls = 1
                while not all(comm.allgather(growing.done())):
                    polls += 1
                    time.sleep(0.02)
                spawned_run = growing.outcome()
                event["polls"] = polls
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
    growing = Growing(comm, __file__, [str(OUT)], 1)  # cancelled at once: given up on every rank
    ended = growing.cancel(60)
    try:
        growing.outcome()
        cancelled = "joined"
    except ProcessFailed as failure:
        cancelled = failure.where
    if not spawned:
        result = {"events": events, "sums": sums, "cancel": {"ended": ended, "outcome": cancelled}}
        (OUT / f"out.{comm.Get_rank()}.json").write_text(json.dumps(result))
    mark_finished(comm)  # lightning-mpi --heal: finished, whatever mpirun reports or waits for
    free(comm)


if __name__ == "__main__":
    main()
