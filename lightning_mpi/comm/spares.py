"""Spare ranks launched with the job (``lightning-mpi --heal --spares K``): they wait, idle, until
the survivors of a heal let them in, with no dynamic-process call.

A replacement spawned after a loss (:mod:`.respawn`) costs the survivors its start-up (the
interpreter, the imports, the model: seconds of CPU) and goes through Open MPI's dynamic-process
calls (``Spawn``, ``Merge``), which ULFM heals less reliably than the static ones. A spare is a
process of the job itself: it ran the user's script up to the strategy's construction, like every
rank, and waits there. What it and the training ranks share is one communicator, the *pool*
(``COMM_WORLD`` duplicated before anything else), so a let-in needs only ULFM's own healing calls:

1. at the first strategy of each process (:func:`split_off_spares`, collective over
   ``COMM_WORLD``): the last ``K`` ranks of the job are spares, the others train over their own
   communicator (``COMM_WORLD`` split by role: a training rank never sees the spares again);
2. a spare waits on the pool (:func:`wait_as_spare`: a receive it tests every 20 ms, sleeping in
   between, so it takes no CPU from the training ranks);
3. after a heal the survivors call :func:`call_spares` (collective over them): they revoke the
   pool, which wakes every spare; survivors and spares shrink it (:func:`~.ulfm.heal`: ``Shrink``
   and ``Agree``, the dead excluded), tell each other who is who (one ``allgather``), and split it:
   the survivors (keeping their ranks) and the first spares, as many as ranks were lost, become
   the merged communicator of the grown run, as :func:`~.respawn.respawn` returns it; the other
   spares wait again on the shrunk pool;
4. at the end of the job, rank 0 of the training ranks dismisses the spares still waiting
   (:func:`dismiss_spares`, at exit): each leaves with ``SystemExit(0)``.

A spare waits in the construction of the script's first strategy, so it takes a place only in
that strategy's run (:func:`spares_left`): a script that builds another (a second ``fit`` with a
new Trainer) has lost ranks replaced by spawned processes from then on.

A spare costs the job its memory and its start-up at launch time, nothing while it waits. Without
``LIGHTNING_MPI_SPARES`` (the default) nothing here runs.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from lightning_mpi.comm.errors import failed_ranks, process_failure
from lightning_mpi.comm.liveness import beacon, quorum
from lightning_mpi.comm.quorum import Beacon
from lightning_mpi.comm.respawn import Respawned
from lightning_mpi.comm.ulfm import free, heal, majority

__all__ = [
    "SPARES_ENV",
    "call_spares",
    "dismiss_spares",
    "is_spare",
    "requested",
    "spares_left",
    "split_off_spares",
    "training_world",
    "wait_as_spare",
    "waiting_beacons",
]

#: Exported by ``lightning-mpi --spares K``: the number of spare ranks at the end of the job.
SPARES_ENV = "LIGHTNING_MPI_SPARES"
#: The tag of the message that dismisses a waiting spare (its payload: 0).
DISMISS_TAG = 7411
#: Seconds a waiting spare sleeps between two tests of its receive.
POLL_S = 0.02


@dataclass
class SparePool:
    """The pool: every live process of the job, training ranks and spares.

    - ``comm``: the pool communicator (``MPI.ERRORS_RETURN``);
    - ``spare``: this process is a spare still waiting;
    - ``spare_ranks``: the ranks in ``comm`` of the spares still waiting (the same everywhere);
    - ``start_training``: the training ranks the job was launched with;
    - ``beacons``: where each process of ``comm`` hears its quorum's beats (:mod:`.quorum`), by rank.
    """

    comm: Any
    spare: bool
    spare_ranks: tuple[int, ...]
    start_training: int
    beacons: tuple[Beacon | None, ...]

    def training_side(self, min_ranks: int | None) -> bool:
        """Whether the training ranks this process knows alive are at least ``min_ranks`` (``None``:
        more than half of :attr:`start_training`, the strategies' default): ``False`` on the side
        of a partition that stops, or once the run itself stopped."""
        dead = set(failed_ranks(self.comm))
        waiting = set(self.spare_ranks)
        alive = sum(1 for rank in range(self.comm.Get_size()) if rank not in dead and rank not in waiting)
        return alive >= self.min_ranks(min_ranks)

    def min_ranks(self, requested: int | None) -> int:
        """The strategy's ``min_ranks`` (``requested``), by default more than half of :attr:`start_training`."""
        return requested if requested is not None else majority(self.start_training)

    def watch(self, min_ranks: int | None) -> None:
        """Tell this process's quorum (when there is one) who trains and who waits, by the pool."""
        found = quorum()
        if found is None:
            return
        waiting = set(self.spare_ranks)
        training = [b for rank, b in enumerate(self.beacons) if rank not in waiting]
        found.watch(training, [self.beacons[rank] for rank in self.spare_ranks], self.min_ranks(min_ranks))


_POOL: list[SparePool] = []
#: strategies built in this process (:func:`strategy_built`): a spare waits in its first, so it can
#: take a place only in the run of the first strategy of the script
_BUILT = [0]
#: the communicator the training ranks train over now (set by the strategy's environment, at the
#: split and after every heal): its rank 0 dismisses the spares at exit
_TRAINING: list[Any] = []


def training_world(comm: Any) -> None:
    """``comm`` is the communicator this process trains over now (its rank 0 dismisses the spares)."""
    _TRAINING[:] = [comm]


def waiting_beacons() -> tuple[Beacon | None, ...]:
    """Where the spares still waiting hear beats (:mod:`.quorum`); ``()`` without spares."""
    if not _POOL:
        return ()
    pool = _POOL[0]
    return tuple(pool.beacons[rank] for rank in pool.spare_ranks)


def requested(environ: Any = None) -> int:
    """The spares the launcher asked for (``LIGHTNING_MPI_SPARES``), 0 when unset.

    Raises:
        ValueError: the value is not a whole number ≥ 0.
    """
    raw = (os.environ if environ is None else environ).get(SPARES_ENV, "")
    if not raw:
        return 0
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{SPARES_ENV}={raw!r}: expected a whole number of spare ranks (0 or more)")
    return count


def split_off_spares(world: Any, count: int) -> Any:
    """Collective over ``world`` (``COMM_WORLD``), once per process: make the pool and return the
    communicator this process trains over (the spares' own, for a spare). The last ``count`` ranks
    are spares; at least one rank must train.

    Raises:
        ValueError: ``count`` leaves no rank to train.
    """
    from mpi4py import MPI

    size, rank = world.Get_size(), world.Get_rank()
    if count >= size:
        raise ValueError(
            f"{SPARES_ENV}={count} spare ranks in a job of {size}: no rank would train; launch more ranks than spares"
        )
    pool = world.Dup()
    pool.Set_errhandler(MPI.ERRORS_RETURN)
    spare = rank >= size - count
    beacons = tuple(world.allgather(beacon()))
    _POOL[:] = [SparePool(pool, spare, tuple(range(size - count, size)), size - count, beacons)]
    own = world.Split(1 if spare else 0, rank)
    if not spare:
        training_world(own)
        atexit.register(dismiss_spares)
    return own


def strategy_built() -> None:
    """A strategy was built in this process (its cluster environment counts it)."""
    _BUILT[0] += 1


def is_spare() -> bool:
    """Whether this process is a spare still waiting."""
    return bool(_POOL) and _POOL[0].spare


def spares_left() -> int:
    """The spares still waiting that can take a place now (the same number on every training
    process): 0 once the script built a second strategy, since a spare waits in the construction of
    the first (let in then, it would run that part of the script; spawned processes replace ranks
    instead), else every spare still waiting."""
    return len(_POOL[0].spare_ranks) if _POOL and _BUILT[0] == 1 else 0


def wait_as_spare(min_ranks: int | None = None) -> Any:
    """In a spare: wait until the survivors of a heal let this process in, and return the merged
    communicator of the grown run (survivors first, as :func:`~.respawn.join_parent` returns it),
    or leave with ``SystemExit(0)`` when the job ends without needing it. A spare that sees fewer
    training ranks alive than ``min_ranks`` (the strategy's; ``None``: more than half) is on the side
    of a partition that stops: it leaves at once (exit code 0). Waiting on, it would report the other
    side's ranks failed once the link is back, and a live rank reported failed aborts (measured: a
    rank of the side that had healed and gone on aborted when a 15 s partition ended)."""
    import numpy as np
    from mpi4py import MPI

    while True:
        pool = _POOL[0]
        pool.watch(min_ranks)
        message = np.zeros(1, dtype=np.int64)
        request = pool.comm.Irecv(message, source=MPI.ANY_SOURCE, tag=DISMISS_TAG)
        woken = False
        while not woken:
            try:
                if request.Test():
                    raise SystemExit(0)  # dismissed: the job ended
            except MPI.Exception as error:
                if error.Get_error_class() == MPI.ERR_REVOKED:
                    woken = True  # the survivors of a heal call the spares
                    continue
                if process_failure(error) is None:
                    raise
                # a process of the pool died: acknowledged, and this spare waits on (the survivors
                # revoke the pool when they call it), unless it is left on a side that stops
                pool.comm.Ack_failed()
                if not pool.training_side(min_ranks):
                    _leave_cut_off()
                request = pool.comm.Irecv(message, source=MPI.ANY_SOURCE, tag=DISMISS_TAG)
                continue
            time.sleep(POLL_S)
        merged = _regroup(pool, survivor_rank=-1, wanted=0)
        if merged is not None:
            return merged


def _leave_cut_off() -> None:
    """A spare on the side of a partition that stops (or of a run that stopped): leave now, no MPI
    call."""
    sys.stderr.write(
        "lightning_mpi: a spare sees fewer training ranks alive than min_ranks (the side of a partition that "
        "stops, or a run that stopped): it leaves\n"
    )
    sys.stderr.flush()
    os._exit(0)


def call_spares(survivors: Any, wanted: int) -> Respawned | None:
    """The survivors of a heal (collective over ``survivors``, their healed communicator) let up to
    ``wanted`` waiting spares in. Returns the grown run's merged communicator and the new ranks in
    it, as :func:`~.respawn.respawn` does (``new_ranks`` empty when no spare is left alive), or
    ``None`` without a pool or a spare waiting (nothing collective then: the count is the same on
    every survivor)."""
    if not _POOL or not _POOL[0].spare_ranks or wanted <= 0:
        return None
    start = time.perf_counter()
    merged = _regroup(_POOL[0], survivor_rank=survivors.Get_rank(), wanted=wanted)
    assert merged is not None, "a survivor is always in the merged communicator"
    size = merged.Get_size()
    joined = tuple(range(survivors.Get_size(), size))
    return Respawned(merged, joined, time.perf_counter() - start)


def _regroup(pool: SparePool, survivor_rank: int, wanted: int) -> Any | None:
    """Survivors and spares together (collective over every live process of the pool): revoke and
    shrink the pool, say who is who, and split it into the grown run (the survivors by their rank,
    then the first ``wanted`` spares) and the spares left waiting. Returns the merged communicator,
    or ``None`` in a spare left waiting (on the shrunk pool)."""
    from mpi4py import MPI

    spare = survivor_rank < 0
    healed = heal(pool.comm)  # revokes the pool first: the waiting spares wake
    free(pool.comm)  # revoked: released here, locally
    comm = healed.comm
    roles = comm.allgather((int(spare), survivor_rank, int(wanted), beacon()))
    wanted = max(w for _, _, w, _ in roles)  # the survivors' number (a spare says 0)
    survivors = sum(1 for s, _, _, _ in roles if not s)
    spares = [rank for rank, (s, _, _, _) in enumerate(roles) if s]
    chosen = spares[:wanted]
    me = comm.Get_rank()
    stays = spare and me not in chosen
    key = survivor_rank if not spare else (survivors + chosen.index(me) if me in chosen else me)
    merged = comm.Split(1 if stays else 0, key)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    left = tuple(rank for rank in spares if rank not in chosen)
    _POOL[:] = [SparePool(comm, stays, left, pool.start_training, tuple(b for _, _, _, b in roles))]
    if stays:
        merged.Free()
        return None
    if spare:  # let in: from now on a training rank, which may end up dismissing the others
        atexit.register(dismiss_spares)
    return merged


def dismiss_spares() -> None:
    """At the end of a training process: rank 0 of the training ranks tells every spare still
    waiting to leave (a small message each; registered at exit by :func:`split_off_spares`)."""
    import numpy as np

    if not _POOL or _POOL[0].spare or not _POOL[0].spare_ranks or not _TRAINING:
        return
    try:
        if _TRAINING[0].Get_rank() != 0:
            return
    except Exception:  # noqa: BLE001  (a communicator freed at the end: nothing to say)
        return
    pool = _POOL[0]
    for rank in pool.spare_ranks:
        try:
            pool.comm.Send(np.zeros(1, dtype=np.int64), dest=rank, tag=DISMISS_TAG)
        except Exception:  # noqa: BLE001  (at exit: a spare that died needs no dismissal)
            pass
