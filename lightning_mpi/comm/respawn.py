"""Replacing lost ranks: spawn new processes and merge them after the survivors of a heal
(``heal="replace"``), with ``Comm.Spawn`` + ``Merge`` under ULFM (Open MPI 5).

:func:`respawn` runs on the survivors, :func:`join_parent` in the new processes; the new ranks come
after the survivors, who keep their ranks. Measured with Open MPI 5.0.11 (``tests/comm/test_ulfm.py``):
spawning one process and merging it takes about 1 s plus the new interpreter's imports, and
three things need care, each handled here:

- a process of another job (a spawned one) that died before it first talked to a survivor is
  never reported: a receive from it, a merge with it and even a revoke that has to reach it wait
  forever. New processes therefore say hello first, with a timeout (:func:`respawn`);
- Open MPI connects processes of different jobs lazily, and a revoke forwarded to a process that
  died before the connection was made waits forever: every pair is connected right after the
  merge (:func:`_connect_every_pair`);
- ``MPI_Finalize`` crashes on communicators still reaching a dead spawned process: free every
  communicator of a healed run before the end (:func:`~lightning_mpi.comm.ulfm.free`).

MPI only (mpi4py, loaded on first use): no torch, no Lightning.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_mpi.comm.errors import ProcessFailed, failures_raised, process_failure
from lightning_mpi.comm.resources import keep_pending
from lightning_mpi.comm.ulfm import free, require_heal, revoke

__all__ = [
    "JOINED",
    "JOIN_TIMEOUT",
    "READY_TAG",
    "REPLACEMENT_ENV",
    "Respawned",
    "join_parent",
    "placement",
    "respawn",
]

#: Seconds the survivors wait for a spawned process to join (:func:`respawn`).
JOIN_TIMEOUT = 120.0
#: Seconds the survivors still wait for hellos once a spawn is cancelled (:func:`respawn`), so that
#: the new processes starting up are told to leave rather than left waiting.
CANCEL_GRACE = 5.0
#: Tag of a spawned process's hello to its parents, and of their answer.
HELLO_TAG = 7410
#: Tag of a new process's "ready" to rank 0 of the merged communicator (:mod:`.spawned`).
READY_TAG = 7412
#: Set (to ``"1"``) in the environment of a process started by :mod:`.spawned`: a script can tell
#: that it runs as a replacement (``MPI.Comm.Get_parent()`` is null once it joined).
REPLACEMENT_ENV = "LIGHTNING_MPI_REPLACEMENT"
#: The merged communicator of a process started by :mod:`.spawned` (joined before its script ran).
JOINED: list[Any] = []
#: The bit of :func:`respawn`'s agreement that every rank leaves set while it was not cancelled.
_GOING = 2


@dataclass(frozen=True)
class Respawned:
    """The outcome of :func:`respawn` on a survivor (the same on every survivor).

    - ``comm``: survivors then new ranks (``MPI.ERRORS_RETURN`` set); a survivor keeps its rank.
    - ``new_ranks``: the ranks of the spawned processes in ``comm`` (``()`` when none joined).
    - ``seconds``: how long it took on this rank (the spawn includes the new interpreters' start).
    - ``attempts``: spawns tried (more than 1 when a new process died before it joined).
    """

    comm: Any
    new_ranks: tuple[int, ...]
    seconds: float
    attempts: int = 1


def respawn(
    comm: Any,
    script: str,
    argv: Sequence[str] = (),
    n: int = 1,
    *,
    python: str = sys.executable,
    join_timeout: float = JOIN_TIMEOUT,
    attempts: int = 2,
    cancelled: Callable[[], bool] | None = None,
    hosts: Sequence[str] | None = None,
) -> Respawned:
    """Start ``n`` new processes running ``python script argv...`` and merge them after the ranks of
    ``comm`` (the healed communicator). Collective over ``comm``; the new processes must call
    :func:`join_parent` (their half) within ``join_timeout`` seconds of starting.

    Open MPI 5.0.11 does not report a new process that dies before it first talked to its
    parents: a receive from it, a merge with it and even a revoke of the intercommunicator then
    wait forever (measured). So every new process first says hello to rank 0 of ``comm``, which
    waits for all of them until ``join_timeout``; the ranks of ``comm`` agree on the outcome
    (``Agree``), rank 0 tells each new process that said hello whether to merge, and they merge
    only when every new process is alive. Otherwise the spawn is given up (the new processes that
    said hello are told so, and exit from :func:`join_parent` with :class:`ProcessFailed`) and
    tried again, up to ``attempts`` times in all; then :class:`ProcessFailed`
    (``where="respawn"``) is raised and ``comm`` is still usable. A new process that dies after
    joining is a failure like any other: heal the merged communicator.

    ``hosts``: where to start each new process on the first try (the MPI ``host`` info key, one
    per process: :func:`placement`); a second try leaves the place to Open MPI's runtime.

    ``cancelled`` (for a spawn in a thread of its own, :class:`~.healing.Growing`): once it returns
    ``True`` on any rank of ``comm``, rank 0 waits at most :data:`CANCEL_GRACE` more for hellos, the
    spawn is given up on every rank (the ranks agree on it; the new processes that said hello leave
    with exit code 0) and not tried again: :class:`ProcessFailed` (``where="respawn (cancelled)"``).
    """
    from mpi4py import MPI

    if n < 1:
        raise ValueError(f"n={n!r}: the number of processes to spawn must be >= 1")
    require_heal()
    start = time.perf_counter()
    stop = cancelled if cancelled is not None else (lambda: False)
    for attempt in range(1, attempts + 1):
        merged: Any = None
        inter: Any = None
        heard: list[int] = []
        try:
            if hosts and attempt == 1:
                infos = [MPI.Info.Create() for _ in range(n)]
                for info, host in zip(infos, hosts, strict=True):
                    info.Set("host", host)
                commands, args = [python] * n, [[script, *argv]] * n
                inter = comm.Spawn_multiple(commands, args=args, maxprocs=[1] * n, info=infos, root=0)
                for info in infos:
                    info.Free()
            else:
                inter = comm.Spawn(python, args=[script, *argv], maxprocs=n, root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            if comm.Get_rank() == 0:
                heard = _hellos(inter, join_timeout, stop)
            alive = int(comm.Get_rank() != 0 or len(heard) == n)
        except MPI.Exception as error:
            if process_failure(error) is None and error.Get_error_class() != MPI.ERR_SPAWN:
                raise
            alive = 0
        joined = 0
        going = _GOING  # cleared by the agreement when any rank was cancelled: no merge, no second try
        try:
            # every survivor takes the same branch (only rank 0 heard them), and stops on anyone's cancel
            agreed = comm.Agree(alive | (0 if stop() else _GOING))
            going = agreed & _GOING
            alive = agreed & 1 if going else 0
            for child in heard:  # only those that said hello: the others cannot be reached safely
                inter.Send(np.array([alive], dtype=np.int32), dest=child, tag=HELLO_TAG)
            if alive:
                merged = inter.Merge(high=False)
                merged.Set_errhandler(MPI.ERRORS_RETURN)
                _connect_every_pair(merged)
                joined = 1
        except MPI.Exception as error:
            if process_failure(error) is None:
                raise
        try:
            joined = comm.Agree(joined)  # a merge can complete on some survivors and fail on others
        except MPI.Exception as error:
            failed = process_failure(error, comm, "respawn")
            if failed is None:
                raise
            revoke(merged)
            raise failed from error
        free(inter)  # local: never revoked, a dead new process would make the revoke wait forever
        if joined:
            size = merged.Get_size()
            return Respawned(merged, tuple(range(size - n, size)), time.perf_counter() - start, attempt)
        revoke(merged)
        free(merged)
        if not going:
            raise ProcessFailed((), "respawn (cancelled)")
    raise ProcessFailed((), f"respawn (every one of {attempts} spawns lost a new process before it joined)")


def placement(hosts: Sequence[str], n: int) -> list[str]:
    """Where to start ``n`` new processes, given the host of every rank left (``hosts``, by rank):
    each on the host with the fewest ranks so far, the first such host in rank order on a tie. So a
    rank killed on a host that is still there is replaced on that host, and the ranks of a host cut
    off are spread over the others, not piled onto one that a next cut would take whole."""
    count: dict[str, int] = {}
    for host in hosts:
        count[host] = count.get(host, 0) + 1
    chosen = []
    for _ in range(n):
        host = min(count, key=count.__getitem__)  # dicts keep rank order: the first on a tie
        count[host] += 1
        chosen.append(host)
    return chosen


def _hellos(inter: Any, timeout: float, cancelled: Callable[[], bool]) -> list[int]:
    """On rank 0 of the parents: the spawned processes that said hello within ``timeout`` seconds
    (all of them as soon as they have), or within :data:`CANCEL_GRACE` of ``cancelled()``: those
    that said hello are then told to leave (exit code 0), not left waiting for an answer."""

    size = inter.Get_remote_size()
    inbox = np.zeros(size, dtype=np.int32)
    requests = [inter.Irecv(inbox[i : i + 1], source=i, tag=HELLO_TAG) for i in range(size)]
    done = [False] * size
    deadline = time.monotonic() + timeout
    was_cancelled = False
    while not all(done) and time.monotonic() < deadline:
        if not was_cancelled and cancelled():
            was_cancelled, deadline = True, min(deadline, time.monotonic() + CANCEL_GRACE)
        done = [d or bool(r.Test()) for d, r in zip(done, requests, strict=True)]
        time.sleep(0.001)
    for request, completed in zip(requests, done, strict=True):
        if not completed:
            request.Cancel()
    return [i for i in range(size) if done[i]]


def join_parent() -> Any | None:
    """In a process started by :func:`respawn`: the merged communicator (this process's rank comes
    after the survivors'), ``MPI.ERRORS_RETURN`` set. ``None`` in a process that was not spawned.

    Call it early (before long imports): the survivors give a new process ``join_timeout``
    seconds. If they gave this spawn up (another new process died, or this one was too slow),
    :class:`ProcessFailed` is raised: exit.
    """
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    verdict = np.zeros(1, dtype=np.int32)
    with failures_raised(parent, "joining the survivors"):
        parent.Send(np.array([parent.Get_rank()], dtype=np.int32), dest=0, tag=HELLO_TAG)
        parent.Recv(verdict, source=0, tag=HELLO_TAG)
        if not verdict[0]:
            free(parent)
            raise ProcessFailed((), "joining the survivors (they gave this spawn up)")
        merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    free(parent)
    _connect_every_pair(merged)
    return merged


def _connect_every_pair(comm: Any) -> None:
    """One message between every pair of ranks of ``comm`` (collective, blocking).

    Open MPI connects processes of different jobs (survivors and spawned ones) lazily, on their
    first message. ULFM's revoke is forwarded along a graph of ranks that need not have talked
    before, and connecting to a process that has died meanwhile blocks forever (in ``PMIx_Get``,
    measured with Open MPI 5.0.11): connect every pair now, while everyone is alive.
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    out, inbox = np.full(size, rank, dtype=np.int32), np.empty(size, dtype=np.int32)
    requests = []
    for peer in range(size):
        if peer != rank:
            requests.append(comm.Irecv(inbox[peer : peer + 1], source=peer, tag=7411))
            requests.append(comm.Isend(out[peer : peer + 1], dest=peer, tag=7411))
    try:
        MPI.Request.Waitall(requests)
    except MPI.Exception:
        keep_pending((requests, out, inbox))  # a peer died: freed sends to it would abort this process
        raise
