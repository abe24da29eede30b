"""Warm spares for ``heal="replace"``: a process spawned *before* any rank is lost, that has
imported everything, built its strategy and waits, idle, to be let in.

A replacement spawned after a loss (:func:`~.healing.start_growth`) costs the survivors the new
interpreter's start-up (torch, Lightning, the user's script: 5-15 s) at the smaller world size. A
warm spare has paid it already, so after a heal the survivors let it in at once: the run is back
at its world size a step or two after the loss.

The spare is rank 0's alone, so spawning it involves nobody else:

- :func:`spawn_spare` (rank 0 of the run): ``MPI.COMM_SELF.Spawn`` of ``python -m
  lightning_mpi.comm.spawned --spare SCRIPT ARGS``; the new process says hello at once (before its
  imports), and the two merge into a two-process *bridge* (rank 0: 0, the spare: 1). Other ranks
  train on; rank 0 is held about a second.
- :meth:`Spare.ready` (rank 0, without waiting): the spare said it is ready (its strategy is built).
  A spare that died raises :class:`~.ulfm.ProcessFailed`.
- :func:`let_in` (collective over the survivors' communicator): rank 0 tells the spare to come
  and waits for its answer over the bridge (point to point, so a spare that died is found before
  anything collective starts), broadcasts whether it came, and then the survivors accept the
  spare on a port rank 0 opened (``Accept``/``Connect``) and merge: survivors first, keeping
  their ranks, the spare last, as :func:`~.respawn.respawn` returns it.
- :meth:`Spare.dismiss` (rank 0): the run ended or the spare is given up; it exits.

On the spare's side, :func:`wait_to_be_let_in` sends "ready" (and again every second: Open MPI
does not report the death of a process of another job reliably, so rank 0 takes a spare silent
for 5 s for dead), then polls the bridge (every 10 ms, idle otherwise) until rank 0 says come
(it answers and connects to the port rank 0 opened) or go (it exits). A spare whose rank
0 died is of no use to anyone (nobody else can reach it): it exits too, and the healed run's new
rank 0 spawns a spare of its own.

MPI only (mpi4py, loaded on first use): no torch, no Lightning.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_mpi.comm.respawn import HELLO_TAG, JOIN_TIMEOUT, Respawned, _connect_every_pair, _hellos
from lightning_mpi.comm.ulfm import ProcessFailed, failures_raised, free, process_failure, require_heal

__all__ = ["BRIDGE", "SPARE_ARG", "Spare", "SpareDismissed", "let_in", "spawn_spare", "wait_to_be_let_in"]

#: The argument of :mod:`.spawned` that makes the new process a warm spare.
SPARE_ARG = "--spare"
#: Tags on the bridge: the spare's "ready", rank 0's "come" (1) or "go" (0), the spare's answer.
SPARE_READY_TAG = 7420
SPARE_CALL_TAG = 7421
SPARE_ANSWER_TAG = 7422
#: Seconds rank 0 waits for a called spare's answer before it gives the spare up.
ANSWER_TIMEOUT = 5.0
#: Seconds between a waiting spare's looks at the bridge (it is idle in between).
POLL_SECONDS = 0.01
#: Seconds between a waiting spare's "still here" to rank 0, and the silence after which rank 0
#: takes it for dead.
HEARTBEAT_SECONDS = 1.0
SILENCE_SECONDS = 5.0


@dataclass
class Spare:
    """A warm spare, on rank 0 of the run that spawned it.

    - ``bridge``: rank 0 (0) and the spare (1), ``MPI.ERRORS_RETURN`` set.
    - ``spawned_at``: ``time.perf_counter()`` at the spawn; ``seconds``: how long the spawn held rank 0.
    """

    bridge: Any
    spawned_at: float
    seconds: float
    is_ready: bool = False
    closed: bool = False
    port: str | None = None  # the port the survivors accept the called spare on (rank 0's)
    heard_at: float = 0.0  # time.monotonic() when rank 0 last drained a message of the spare

    def ready(self) -> bool:
        """Whether the spare said it is ready, without waiting. Raises :class:`ProcessFailed` when
        it died (and then it is closed)."""
        if self.closed:
            raise ProcessFailed((), "a warm spare (given up)")
        now = time.monotonic()
        try:
            with failures_raised(self.bridge, "a warm spare"):
                while self.bridge.Iprobe(source=1, tag=SPARE_READY_TAG):
                    self.bridge.Recv(np.zeros(1, dtype=np.int32), source=1, tag=SPARE_READY_TAG)
                    self.is_ready, self.heard_at = True, now
        except ProcessFailed:
            self.close()
            raise
        if self.is_ready and now - self.heard_at > SILENCE_SECONDS:
            # Open MPI does not report the death of a process of another job reliably (measured:
            # a spare SIGKILLed while it waits is never reported to rank 0): its heartbeat is
            self.close()
            raise ProcessFailed((), f"a warm spare (silent for {now - self.heard_at:.1f} s)")
        return self.is_ready

    def call(self, timeout: float = ANSWER_TIMEOUT) -> bool:
        """Tell the (ready) spare to come and wait for its answer: ``True`` when it answered, ``False``
        when it died or did not answer within ``timeout`` (then it is closed)."""
        from mpi4py import MPI

        answer = np.zeros(1, dtype=np.int32)
        try:
            if not self.ready():
                return False
            with failures_raised(self.bridge, "calling a warm spare"):
                self.port = MPI.Open_port()
                self.bridge.Send(np.ones(1, dtype=np.int32), dest=1, tag=SPARE_CALL_TAG)
                self.bridge.send(self.port, dest=1, tag=SPARE_CALL_TAG)
                request = self.bridge.Irecv(answer, source=1, tag=SPARE_ANSWER_TAG)
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
        """Tell the spare to exit (the run ended, or it is given up) and free the bridge. Errors are
        ignored: a spare that died needs no telling."""
        if self.closed:
            return
        try:
            self.bridge.Send(np.zeros(1, dtype=np.int32), dest=1, tag=SPARE_CALL_TAG)
        except Exception as error:  # noqa: BLE001  (a dead spare: nothing to tell)
            if process_failure(error) is None:
                raise
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            free(self.bridge)
        if self.port is not None:
            from mpi4py import MPI

            port, self.port = self.port, None
            try:
                MPI.Close_port(port)
            except MPI.Exception:
                pass


class SpareDismissed(SystemExit):
    """Raised in a warm spare that rank 0 dismissed (the run ended) or lost: the process exits
    with code 0 wherever it is (it never trained)."""

    def __init__(self) -> None:
        super().__init__(0)


#: A warm spare's bridge to rank 0, put here by :mod:`.spawned` before the script runs.
BRIDGE: list[Any] = []


def spawn_spare(
    script: str, argv: Sequence[str] = (), *, python: str = sys.executable, join_timeout: float = JOIN_TIMEOUT
) -> Spare | None:
    """On rank 0 of a run (not collective): spawn a warm spare running ``script argv...`` and merge
    it into a bridge. ``None`` when it did not say hello within ``join_timeout`` seconds (it died
    at start-up: Open MPI does not report that, see :mod:`.respawn`)."""
    from mpi4py import MPI

    require_heal()
    start = time.perf_counter()
    inter: Any = None
    try:
        args = ["-m", "lightning_mpi.comm.spawned", SPARE_ARG, script, *argv]
        inter = MPI.COMM_SELF.Spawn(python, args=args, maxprocs=1)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        alive = _hellos(inter, join_timeout) == [0]
        if alive:
            inter.Send(np.ones(1, dtype=np.int32), dest=0, tag=HELLO_TAG)
            bridge = inter.Merge(high=False)
            bridge.Set_errhandler(MPI.ERRORS_RETURN)
            _connect_every_pair(bridge)
            return Spare(bridge, start, time.perf_counter() - start)
        return None
    except MPI.Exception as error:
        if process_failure(error) is None and error.Get_error_class() != MPI.ERR_SPAWN:
            raise
        return None
    finally:
        free(inter)  # local; never revoked (a dead spawned process would make the revoke wait forever)


def let_in(base: Any, spare: Spare | None) -> Respawned | None:
    """Collective over ``base`` (the survivors; ``spare`` is rank 0's, ``None`` elsewhere): call the
    spare and, when it came, merge it after the survivors. Returns the merged communicator as
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
        # Accept/Connect (Open MPI's dynamic-process path, as Spawn), not Create_intercomm through
        # the bridge: Open MPI 5.0.11's HAN collectives crash (SIGSEGV in mca_coll_han_comm_create)
        # on the first collective of a communicator merged from the latter (measured).
        port = spare.port if rank == 0 and spare is not None else None
        inter = base.Accept(port, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        free(inter)
        _connect_every_pair(merged)
    if spare is not None:
        spare.close()  # closes the port too
    size = merged.Get_size()
    return Respawned(merged, (size - 1,), time.perf_counter() - start, 1)


def wait_to_be_let_in(bridge: Any) -> Any:
    """In a warm spare (its strategy built): say ready, then wait until rank 0 calls. Returns the
    merged communicator (the survivors, then this process), ``MPI.ERRORS_RETURN`` set. Raises
    :class:`SpareDismissed` when rank 0 dismissed this spare or died: the process exits."""
    from mpi4py import MPI

    call = np.zeros(1, dtype=np.int32)
    try:
        with failures_raised(bridge, "a warm spare waiting"):
            beat = 0.0
            while not bridge.Iprobe(source=0, tag=SPARE_CALL_TAG):
                if time.monotonic() - beat >= HEARTBEAT_SECONDS:  # "ready", then "still here"
                    bridge.Send(np.ones(1, dtype=np.int32), dest=0, tag=SPARE_READY_TAG)
                    beat = time.monotonic()
                time.sleep(POLL_SECONDS)
            bridge.Recv(call, source=0, tag=SPARE_CALL_TAG)
            if not call[0]:
                free(bridge)
                raise SpareDismissed()
            port = bridge.recv(source=0, tag=SPARE_CALL_TAG)
            bridge.Send(np.ones(1, dtype=np.int32), dest=0, tag=SPARE_ANSWER_TAG)
            inter = MPI.COMM_SELF.Connect(port, root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            merged = inter.Merge(high=True)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            free(inter)
            _connect_every_pair(merged)
    except ProcessFailed:
        free(bridge)
        raise SpareDismissed() from None
    free(bridge)
    return merged
