"""Warm spares for ``heal="replace"``: a process spawned *before* any rank is lost, that has
imported everything, built its strategy and waits, idle, to be let in.

A replacement spawned after a loss (:func:`~.healing.start_growth`) costs the survivors the new
interpreter's start-up (torch, Lightning, the user's script: 5-15 s) at the smaller world size. A
warm spare has paid it already, so after a heal the survivors let it in at once: the run is back
at its world size a step or two after the loss.

- :func:`spawn_spare` (collective over the run's communicator, about a second): ``Spawn`` of
  ``python -m lightning_mpi.comm.spawned --spare SCRIPT ARGS`` and ``Merge``, as
  :func:`~.respawn.respawn` does for a replacement (the new process says hello before its imports):
  every rank gets a *spare world*, the run's ranks then the spare. Spawning with every rank, not
  with rank 0 alone, is what lets them take the spare in later: Open MPI connects (``PMIx_Connect``)
  the processes of a spawn, and a process that joins a communicator without that (through
  ``Intercomm_create`` with a bridge to rank 0) lacks its locality, on which Open MPI 5.0.11's HAN
  collectives crash and ``Split_type`` hangs (measured); the other way in, ``Accept``/``Connect``,
  needs Open MPI's data server, which failed now and then right after a loss and then left the
  accepting side's other ranks waiting forever (its root returns before the broadcast they wait
  in, dpm.c).
- :meth:`Spare.ready` (the spare world's rank 0, the spare's *leader*, without waiting): the spare
  said it is ready (its strategy is built), and is still there (a heartbeat every second: Open MPI
  does not report the death of a process of another job reliably, so a spare silent for 5 s is
  taken for dead).
- :func:`let_in` (collective over the survivors' communicator): the leader calls the spare and
  waits for its answer (point to point, so a spare that died is found before anything collective
  starts) and broadcasts whether it came; then the survivors and the spare shrink the spare world
  (``Shrink``: its processes still alive, in order: the survivors, keeping their ranks, then the
  spare, as :func:`~.respawn.respawn` returns it). No revoke is needed: the shrink's own agreement
  leaves the ranks lost since the spawn out.
- :meth:`Spare.dismiss` (the leader): the run ended or the spare is given up; it exits.

On the spare's side, :func:`wait_to_be_let_in` sends "ready" (and again every second), then polls
the spare world (every 10 ms, idle otherwise) until the leader says come or go. The spare serves
its leader only: if the leader is lost, the healed run's new rank 0 gives that spare up and
spawns another.

MPI only (mpi4py, loaded on first use): no torch, no Lightning.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_mpi.comm.respawn import JOIN_TIMEOUT, Respawned, _connect_every_pair, respawn
from lightning_mpi.comm.ulfm import ProcessFailed, failures_raised, free, process_failure

__all__ = ["SPARE_WORLD", "SPARE_ARG", "Spare", "SpareDismissed", "let_in", "spawn_spare", "wait_to_be_let_in"]

#: The argument of :mod:`.spawned` that makes the new process a warm spare.
SPARE_ARG = "--spare"
#: Tags in the spare world: the spare's "ready", its leader's "come" (1) or "go" (0), the spare's answer.
SPARE_READY_TAG = 7420
SPARE_CALL_TAG = 7421
SPARE_ANSWER_TAG = 7422
#: Seconds rank 0 waits for a called spare's answer before it gives the spare up.
ANSWER_TIMEOUT = 5.0
#: Seconds between a waiting spare's looks at the spare world (it is idle in between).
POLL_SECONDS = 0.01
#: Seconds between a waiting spare's "still here" to rank 0, and the silence after which rank 0
#: takes it for dead.
HEARTBEAT_SECONDS = 1.0
SILENCE_SECONDS = 5.0


@dataclass
class Spare:
    """A warm spare, on every rank of the run that spawned it.

    - ``world``: the spare world (the run's ranks at the spawn, then the spare), ``MPI.ERRORS_RETURN`` set;
    - ``leader``: whether this rank is the spare's leader (rank 0 of ``world``, the only rank that
      talks to it); ``spare_rank``: the spare's rank in ``world``;
    - ``spawned_at``: ``time.perf_counter()`` at the spawn; ``seconds``: how long the spawn took.
    """

    world: Any
    leader: bool
    spare_rank: int
    spawned_at: float
    seconds: float
    is_ready: bool = False
    closed: bool = False
    heard_at: float = 0.0  # time.monotonic() when the leader last drained a message of the spare

    def ready(self) -> bool:
        """Whether the spare said it is ready, without waiting. Raises :class:`ProcessFailed` when
        it died (and then it is closed)."""
        if self.closed or not self.leader:
            raise ProcessFailed((), "a warm spare (given up, or led by a rank lost since)")
        now = time.monotonic()
        try:
            with failures_raised(self.world, "a warm spare"):
                while self.world.Iprobe(source=self.spare_rank, tag=SPARE_READY_TAG):
                    self.world.Recv(np.zeros(1, dtype=np.int32), source=self.spare_rank, tag=SPARE_READY_TAG)
                    self.is_ready, self.heard_at = True, now
        except ProcessFailed:
            self.close()
            raise
        if self.is_ready and now - self.heard_at > SILENCE_SECONDS:
            # Open MPI does not report the death of a process of another job reliably (measured:
            # a spare SIGKILLed while it waited was not reported to rank 0 within 25 s): its heartbeat is
            self.close()
            raise ProcessFailed((), f"a warm spare (silent for {now - self.heard_at:.1f} s)")
        return self.is_ready

    def call(self, timeout: float = ANSWER_TIMEOUT) -> bool:
        """Tell the (ready) spare to come and wait for its answer: ``True`` when it answered, ``False``
        when it died or did not answer within ``timeout`` (then it is closed)."""
        answer = np.zeros(1, dtype=np.int32)
        try:
            if not self.ready():
                return False
            with failures_raised(self.world, "calling a warm spare"):
                self.world.Send(np.ones(1, dtype=np.int32), dest=self.spare_rank, tag=SPARE_CALL_TAG)
                request = self.world.Irecv(answer, source=self.spare_rank, tag=SPARE_ANSWER_TAG)
                deadline = time.monotonic() + timeout
                while not request.Test():
                    if time.monotonic() > deadline:
                        request.Cancel()
                        self.close()
                        return False
                    time.sleep(0.0005)
        except ProcessFailed:
            self.close()
            return False
        return bool(answer[0])

    def dismiss(self) -> None:
        """The leader tells the spare to exit (the run ended, or it is given up); every rank frees
        the spare world. Errors are ignored: a spare that died needs no telling."""
        if self.closed:
            return
        if self.leader:
            try:
                self.world.Send(np.zeros(1, dtype=np.int32), dest=self.spare_rank, tag=SPARE_CALL_TAG)
            except Exception as error:  # noqa: BLE001  (a dead spare: nothing to tell)
                if process_failure(error) is None:
                    raise
        self.close()

    def close(self) -> None:
        """Free the spare world (local; never revoked: a dead spawned process would make it wait)."""
        if not self.closed:
            self.closed = True
            free(self.world)


class SpareDismissed(SystemExit):
    """Raised in a warm spare that rank 0 dismissed (the run ended) or lost: the process exits
    with code 0 wherever it is (it never trained)."""

    def __init__(self) -> None:
        super().__init__(0)


#: A warm spare's spare world, put here by :mod:`.spawned` before the script runs.
SPARE_WORLD: list[Any] = []


def spawn_spare(
    base: Any,
    script: str,
    argv: Sequence[str] = (),
    *,
    python: str = sys.executable,
    join_timeout: float = JOIN_TIMEOUT,
) -> Spare | None:
    """Collective over the run's ``base``: spawn a warm spare running ``script argv...`` and merge it
    after the run's ranks (:func:`~.respawn.respawn`, one attempt). ``None`` on every rank when it
    died before it said hello (it is not retried). A rank lost meanwhile raises
    :class:`ProcessFailed` (heal, and spawn again later)."""
    start = time.perf_counter()
    args = ["lightning_mpi.comm.spawned", SPARE_ARG, script, *argv]
    try:
        spawned = respawn(base, "-m", args, 1, python=python, join_timeout=join_timeout, attempts=1)
    except ProcessFailed as failure:
        if failure.ranks or not failure.where.startswith("respawn (every"):
            raise
        return None
    world = spawned.comm
    return Spare(world, base.Get_rank() == 0, spawned.new_ranks[0], start, time.perf_counter() - start)


def let_in(base: Any, spare: Spare | None) -> Respawned | None:
    """Collective over ``base`` (the survivors; ``spare`` on every one of them that has it, rank 0
    its leader): call the spare and, when it came, merge it after the survivors. Returns the merged communicator as
    :func:`~.respawn.respawn` does (``new_ranks``: the spare's rank, the last), or ``None`` on
    every survivor when the spare did not come (it died or did not answer; rank 0 closed it).

    A survivor lost during it raises :class:`ProcessFailed` (heal, and call again)."""
    from mpi4py import MPI

    start = time.perf_counter()
    rank = base.Get_rank()
    came = np.zeros(1, dtype=np.int32)
    if rank == 0:
        came[0] = int(spare is not None and not spare.closed and spare.call())
    with failures_raised(base, "letting a warm spare in"):
        base.Bcast(came, root=0)
        if not came[0]:
            return None
        # The spare world shrunk to the processes alive in it: the survivors (in their order) and the
        # spare last. Every survivor is in it (it was spawned over their run) and the ranks lost since
        # are left out by the shrink's own agreement; the spare was connected to every survivor by its
        # spawn (module docstring).
        world = spare.world if spare is not None else None
        if world is None:
            raise RuntimeError("lightning_mpi: a survivor holds no spare world to let the spare in through")
        merged = world.Shrink()
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        if merged.Get_size() != base.Get_size() + 1:
            raise ProcessFailed((), "letting a warm spare in (a rank was lost while it was let in)")
        _connect_every_pair(merged)
    if spare is not None:
        spare.close()
    size = merged.Get_size()
    return Respawned(merged, (size - 1,), time.perf_counter() - start, 1)


def wait_to_be_let_in(world: Any) -> Any:
    """In a warm spare (its strategy built): say ready, then wait until its leader (rank 0 of the
    spare world ``world``) calls. Returns the merged communicator (the survivors, then this
    process), ``MPI.ERRORS_RETURN`` set. Raises :class:`SpareDismissed` when the leader dismissed
    this spare or was lost: the process exits."""
    from mpi4py import MPI

    call = np.zeros(1, dtype=np.int32)
    try:
        with failures_raised(world, "a warm spare waiting"):
            beat = 0.0
            while not world.Iprobe(source=0, tag=SPARE_CALL_TAG):
                if time.monotonic() - beat >= HEARTBEAT_SECONDS:  # "ready", then "still here"
                    world.Send(np.ones(1, dtype=np.int32), dest=0, tag=SPARE_READY_TAG)
                    beat = time.monotonic()
                time.sleep(POLL_SECONDS)
            world.Recv(call, source=0, tag=SPARE_CALL_TAG)
            if not call[0]:
                free(world)
                raise SpareDismissed()
            world.Send(np.ones(1, dtype=np.int32), dest=0, tag=SPARE_ANSWER_TAG)
            merged = world.Shrink()  # with the survivors: they and this process, this one last
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            _connect_every_pair(merged)
    except ProcessFailed:
        free(world)
        raise SpareDismissed() from None
    free(world)
    return merged
