"""A run rebuilt after a heal: what a run made over its communicator, what happens to each piece
when ranks die, and the calls that replace them (:func:`heal_run`, :func:`grow_run`,
:func:`join_run`). MPI only, no Lightning; the strategy rebinds its rule on the result.

What a run builds over its communicator, and what a heal does with it:

=====================================  ==========================================================
made by (module)                       after a shrink
=====================================  ==========================================================
base communicator (the strategy's      revoked; the healed communicator becomes the base. Ranks,
``COMM_WORLD.Dup()``) and its node     world size, local ranks and the node count are read again
communicator (``Split_type``)          from it, and the node communicator is split again.
:class:`~.errors.ErrorChannel`         its ``Dup`` is revoked and freed (locally); a new channel
                                       is made over the healed base (generation 0 on every rank).
each run's :class:`~.transport.        revoked; its :class:`~.resources.RunResources` abandoned;
Transport` (a ``Dup`` of the base)     a new transport over a ``Dup`` of the healed base.
``Transport.dup`` (buckets, pipelined  revoked; freed locally by :func:`release_failed_run`;
segments, the preemption vote),        made again when the rule is bound again (the buckets are
``Transport.node_split``               padded to the world size, the node layout may change).
:class:`~.window.ShardedVector`,       never reused (windows are not fault tolerant): their
:class:`~.window.Counters`,            communicators revoked; the windows freed once every
:class:`~.window.DecisionBoard`        survivor agreed on the same list (else kept for the life
(a ``Dup`` + ``Win.Allocate``)         of the process); new windows on the new transport, filled
                                       from the survivors' state (the lost rank's shard of a
                                       center is gone: the rule rebuilds it).
:class:`~.progress.ProgressThread`     stops polling at the first failure; it must be closed
(a private ``Dup``)                    (``before_release``) before its communicator is freed;
                                       the rebound rule starts a new one.
:class:`~.mailbox.Mailbox` (gossip)    sends to a dead rank never complete: their requests are
                                       kept (:func:`~.resources.keep_pending`), the communicator
                                       freed; messages in flight are dropped.
requests in flight (buckets, votes)    never completed: kept with their buffers.
=====================================  ==========================================================

A survivor therefore (1) catches :class:`~.errors.ProcessFailed`, (2) calls :func:`heal_run` (which
closes the rule through ``before_release``), (3) rebuilds its node layout and binds its rule on
``run.transport`` with the state it kept, and (4) redoes the interrupted exchange. With
``heal="replace"`` it then calls :func:`grow_run` (the survivors wait for the new processes'
start-up), or :class:`Growing` (the spawn in a thread of its own), :func:`poll_ready` at
each step and :func:`finish_growth` (the survivors train on while the new processes start: what
the Trainer strategies do), and the new processes call :func:`join_run` and receive the state from
a survivor.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_mpi.comm.errors import ErrorChannel
from lightning_mpi.comm.resources import RunResources, keep_pending
from lightning_mpi.comm.respawn import JOINED, READY_TAG, Respawned, join_parent, respawn
from lightning_mpi.comm.spares import is_spare, wait_as_spare
from lightning_mpi.comm.transport import Transport
from lightning_mpi.comm.ulfm import Healed, free, heal, retire, revoke

__all__ = [
    "Growing",
    "HealedRun",
    "build_run",
    "finish_growth",
    "grow_run",
    "heal_run",
    "join_run",
    "poll_ready",
    "release_failed_run",
    "run_communicators",
]


@dataclass
class HealedRun:
    """A run rebuilt over a new base communicator (the same on every rank of it).

    - ``base``: the new base communicator (survivors, then spawned ranks after :func:`grow_run`).
    - ``errors``: a new :class:`~.errors.ErrorChannel` over ``base``.
    - ``transport``: a new :class:`~.transport.Transport` over a ``Dup`` of ``base``, watching ``errors``.
    - ``healed``: what :func:`~.ulfm.heal` reported (lost ranks, old -> new ranks, seconds);
      ``None`` on a spawned rank (:func:`join_run`).
    - ``respawned``: what :func:`~.ulfm.respawn` reported, after :func:`grow_run`.
    - ``kept``: failed runs' resources that could not be released (kept referenced).
    """

    base: Any
    errors: ErrorChannel
    transport: Transport
    healed: Healed | None = None
    respawned: Respawned | None = None
    kept: list[RunResources] | None = None

    def close(self) -> None:
        """Free the transport, the error channel and the base communicator (local). Do it before
        the program ends: Open MPI's ``MPI_Finalize`` crashes on communicators still reaching a
        spawned process that died (:func:`~.ulfm.free`)."""
        self.transport.free()
        self.errors.close()
        free(self.base)


def run_communicators(transport: Transport) -> list[Any]:
    """Every communicator the run of ``transport`` uses: its own, those made over it
    (duplicates, node splits, windows' and mailboxes' duplicates, progress threads' private ones,
    all tracked by its :class:`~.resources.RunResources`), and its error channel's."""
    comms = [transport.comm, *transport.resources.comms]
    if transport.errors is not None and transport.errors.comm is not None:
        comms.append(transport.errors.comm)
    return comms


def build_run(base: Any, timeout: float | None, serial: int = 0) -> tuple[ErrorChannel, Transport]:
    """A new error channel and transport over ``base`` (collective over it: two ``Dup``\\ s, in
    this order on every rank, survivors and spawned ranks alike)."""
    errors = ErrorChannel(base)
    resources = RunResources(serial)
    return errors, Transport(resources.comm(base.Dup()), timeout, errors, resources)


def release_failed_run(resources: RunResources, transport: Transport) -> list[RunResources]:
    """Release what a run with dead ranks made, collectively over the survivors' ``transport``;
    returns ``[resources]`` when it kept them instead (nothing released).

    The survivors first agree that each made the same windows (the counts of every rank's
    ``resources``); a window's free synchronises, so it is freed only when all of them free it.
    Windows are freed in creation order, each ignoring the MPI error that the dead ranks cause
    (Open MPI 5 returns one and frees the window); communicators are kept, revoked, until the
    process ends (:func:`~.ulfm.retire`: messages the lost ranks sent on them may still arrive);
    mailboxes' sends to a dead rank never complete, so their requests are kept for the life of the
    process. Call it once nothing uses these resources any more: no thread polls them, no rule
    reads window memory.
    """
    from mpi4py import MPI

    resources.abandon()
    mine = resources.counts()[1:]  # serials may differ: a survivor counts its own runs
    if any(theirs != mine for theirs in transport.agree(mine)):
        warnings.warn(
            "lightning_mpi: after a heal the survivors held different windows, so the failed run's windows "
            "are kept instead of freed.",
            RuntimeWarning,
            stacklevel=2,
        )
        return [resources]
    for box in resources.mailboxes:
        keep_pending(box)  # with its sends to the dead ranks, which never complete
    for window in resources.windows:
        try:
            window.Free()
        except MPI.Exception:
            pass  # the dead ranks' share is gone; the handle is released locally
    retire(*resources.comms)  # freed at exit: what the lost ranks sent on them may still arrive
    resources.windows, resources.comms, resources.mailboxes = [], [], []
    return []


def heal_run(
    transport: Transport,
    base: Any,
    *,
    serial: int = 0,
    also: Sequence[Any] = (),
    before_release: Callable[[], None] | None = None,
) -> HealedRun:
    """Heal after :class:`~.errors.ProcessFailed`: revoke everything the run made, shrink ``base`` to
    the survivors (:func:`~.ulfm.heal`), build a new error channel and transport over the
    survivors' communicator, and release the failed run.

    Collective over the survivors (each calls it once it caught the failure, wherever it did).
    ``also``: more communicators to revoke (the node communicator, a user's). ``before_release``
    runs after the new transport exists and before the failed run is released: close the rule
    there (stop its progress threads). ``serial`` numbers the new run's resources. ``base`` is
    retired with the failed run's other communicators (revoked, freed at exit: :func:`~.ulfm.retire`;
    use ``run.base`` from now on).
    """
    old_errors = transport.errors
    healed = heal(base, also=[*run_communicators(transport), *also])
    transport.resources.abandon()
    errors, fresh = build_run(healed.comm, transport.timeout, serial)
    if before_release is not None:
        before_release()
    kept = release_failed_run(transport.resources, fresh)
    if old_errors is not None:
        old_errors.close(release=retire)
    retire(base)
    return HealedRun(healed.comm, errors, fresh, healed=healed, kept=kept)


def grow_run(
    run: HealedRun, script: str, argv: Sequence[str] = (), n: int = 1, *, serial: int = 0, python: str | None = None
) -> HealedRun:
    """After :func:`heal_run`: spawn ``n`` processes (``python script argv...``, which call
    :func:`join_run`) and rebuild the run over survivors + new ranks (:func:`~.ulfm.respawn`).

    Collective over ``run.base``. The survivors keep their ranks; the new ranks come after them.
    The previous transport and channel are closed (the survivors' communicator stays, as the
    parent of the merged one). On :class:`~.errors.ProcessFailed` from the spawn (new processes kept
    dying), ``run`` is still intact: go on without replacements.
    """
    respawned = respawn(run.base, script, argv, n, python=python or sys.executable)
    errors, fresh = build_run(respawned.comm, run.transport.timeout, serial)
    run.close()
    return HealedRun(respawned.comm, errors, fresh, healed=run.healed, respawned=respawned, kept=run.kept)


class Growing:
    """The survivors' first half of a growth that waits neither for the new processes' imports nor
    for their start: ``n`` processes spawned (``python -m lightning_mpi.comm.spawned script
    argv...``), which join at once (:func:`~.respawn.respawn`), then run ``script``, from a thread
    of its own. Once it has ended the survivors go on over ``base`` and call :func:`poll_ready`
    (rank 0) until every new process is ready, then :func:`finish_growth`.

    The spawn blocks its callers until the new interpreters have started MPI and said hello
    (measured with ``benchmarks/goodput.py``'s ``heal_replace`` at 8 ranks on 2 cores: 1.3 and
    1.8 s per kill in which the survivors trained nothing). Here it runs over a duplicate of
    ``base`` (made now, collective over ``base``; MPI allows collectives of two threads on two
    communicators), and the caller asks :meth:`done` between its own operations; every
    survivor's thread ends with the same outcome (:func:`~.respawn.respawn` agrees on it), which
    :meth:`outcome` returns or raises.

    :meth:`cancel` (training ended, or a survivor was lost and the healed run spawns anew) cuts the
    wait for hellos short (:data:`~.respawn.CANCEL_GRACE`) and rules out a second try, on every
    survivor (they agree on it), and waits for the thread a bounded time: a spawn whose new
    processes never start MPI cannot be interrupted.
    ``hosts``: where to start each new process first (:func:`~.respawn.placement`).
    """

    def __init__(
        self,
        base: Any,
        script: str,
        argv: Sequence[str] = (),
        n: int = 1,
        *,
        python: str | None = None,
        hosts: Sequence[str] | None = None,
    ) -> None:
        self._comm = base.Dup()
        self._cancel = threading.Event()
        self._result: Respawned | BaseException | None = None
        where = list(hosts) if hosts else None
        self._thread = threading.Thread(
            target=self._run, args=(script, list(argv), n, python, where), name="lightning_mpi spawn", daemon=True
        )
        self._thread.start()

    def _run(self, script: str, argv: list[str], n: int, python: str | None, hosts: list[str] | None) -> None:
        try:
            command = ["lightning_mpi.comm.spawned", script, *argv]
            python = python or sys.executable
            self._result = respawn(
                self._comm, "-m", command, n, python=python, cancelled=self._cancel.is_set, hosts=hosts
            )
        except BaseException as error:  # noqa: BLE001  (handed to the training thread by outcome())
            self._result = error

    def done(self) -> bool:
        """Whether this survivor's thread has ended (local; the survivors agree on the moment)."""
        return not self._thread.is_alive()

    def outcome(self) -> Respawned:
        """Once :meth:`done`: the new processes joined to the survivors, or what the spawn raised
        (as :func:`~.respawn.respawn`: :class:`~.errors.ProcessFailed` when none joined, or a
        survivor died)."""
        assert self.done(), "Growing.outcome() before the spawn ended"
        free(self._comm)
        result = self._result
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        return result

    def cancel(self, wait: float) -> bool:
        """Give the spawn up (every survivor calls it, in any order) and wait up to ``wait`` seconds
        for the thread; frees what it made. Returns whether the thread ended."""
        self._cancel.set()
        self._thread.join(timeout=wait)
        if self._thread.is_alive():
            return False
        result = self._result
        if isinstance(result, Respawned):  # joined before the cancel reached it: let the new ones go
            revoke(result.comm)
            free(result.comm)
        free(self._comm)
        return True


def poll_ready(respawned: Respawned, heard: set[int]) -> bool:
    """On rank 0 of the survivors: whether every new process of ``respawned`` said it is ready
    (:func:`join_run`), without waiting; ``heard`` collects those that did. Raises the MPI error
    of a new process that died."""
    import numpy as np

    comm = respawned.comm
    for rank in respawned.new_ranks:
        if rank not in heard and comm.Iprobe(source=rank, tag=READY_TAG):
            comm.Recv(np.zeros(1, dtype=np.int32), source=rank, tag=READY_TAG)
            heard.add(rank)
    return len(heard) == len(respawned.new_ranks)


def finish_growth(run: HealedRun, respawned: Respawned, serial: int = 0) -> HealedRun:
    """The survivors' second half (every new process ready): the run over survivors + new ranks,
    as :func:`grow_run` returns it (collective over ``respawned.comm``; ``run`` is closed)."""
    errors, fresh = build_run(respawned.comm, run.transport.timeout, serial)
    run.close()
    return HealedRun(respawned.comm, errors, fresh, healed=run.healed, respawned=respawned, kept=run.kept)


def join_run(timeout: float | None, serial: int = 0, min_ranks: int | None = None) -> HealedRun | None:
    """In a process spawned by :func:`grow_run` or :class:`Growing`: join the survivors and
    build the same run (its half of the collectives of :func:`grow_run` / :func:`finish_growth`);
    ``None`` in a process that was not spawned. A process started by :mod:`.spawned` joined
    already: it tells rank 0 it is ready and waits for the survivors to let it in. A spare
    (:mod:`.spares`) waits until the survivors of a heal call it (or leaves when the job ends, or
    when it sees fewer than ``min_ranks`` training ranks alive: :func:`~.spares.wait_as_spare`)."""
    import numpy as np

    if JOINED:
        merged = JOINED.pop()
        merged.Send(np.ones(1, dtype=np.int32), dest=0, tag=READY_TAG)
    elif is_spare():
        merged = wait_as_spare(min_ranks)
    else:
        merged = join_parent()
    if merged is None:
        return None
    errors, transport = build_run(merged, timeout, serial)
    return HealedRun(merged, errors, transport)
