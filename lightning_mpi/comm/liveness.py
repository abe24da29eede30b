"""A hung rank is a lost rank: keep live ranks answering Open MPI's heartbeat detector, and kill the
ranks a heal left behind so that they cannot come back. (A rank on the side of a network partition
that stops freezes itself before its detector fires, and a rank that is stopped while its peers go
on is killed within ``lightning-mpi --freeze-timeout``: :mod:`.quorum` and :mod:`.watchdog`,
in a process beside the rank started here by :func:`quorum`.)

Detection is Open MPI's (ULFM): ``lightning-mpi --heal`` turns on its heartbeat failure detector
(``mpi_ft_detector``, with ``--hang-timeout``), and a rank that sends no heartbeat for that long (a
frozen process, a host cut off) is declared failed: the survivors' next operation with it fails,
and they heal as after a kill. Measured with Open MPI 5.0.11 (3 ranks on one machine, a 0.5 s
period and a 2 s timeout): a SIGSTOPped rank was declared failed 1.6 s after it stopped.

Heartbeats leave from MPI's progress engine, which runs only inside an MPI call, and training
spends seconds in torch without one: a rank computing for longer than the timeout was declared
failed although it was alive (measured: an 8 s compute loop, same settings). :class:`Heartbeat`
therefore calls into MPI (``Iprobe`` on ``COMM_SELF``) from a thread every
:data:`BEAT_SECONDS`, so a live process always answers and only a frozen one (every thread
stopped) goes silent. It starts the moment ``mpi4py.MPI`` is imported (MPI initialised) in a
process of such a job (:func:`beat_from_mpi_init`, which ``import lightning_mpi`` calls): a script
that initialises MPI and then imports torch and Lightning, seconds without an MPI call on a loaded
machine, was declared failed before its first collective (measured: 12 ranks on 2 cores). Open
MPI's own detector thread (``mpi_ft_detector_thread``) would do the same but hangs ``MPI_Finalize``
in 5.0.11, and its loop keeps a core busy per rank. A rank whose training thread hangs while its
process still runs (a kernel that never returns) keeps answering: ``collective_timeout`` is what
ends that wait.

A rank declared failed may still be alive: stopped, or cut off by the network. Open MPI aborts
such a process as soon as it learns that it was reported dead (measured: "ompi_proc_mark_as_failed:
I have been reported dead by someone else", then ``SIGABRT``), and the survivors SIGKILL the lost
ranks that run on their own host right after a heal (:class:`Processes`, every rank's host and
pid), so that a frozen process does not linger until it is woken up.

The timeout is a trade-off. A rank is declared failed when no heartbeat left it for that long, and
a heartbeat needs Python's interpreter lock: a rank whose main thread holds it for longer (the
first ``import torch`` loads hundreds of MB of libraries with it held) is taken for a hung one.
Measured with 10 ranks on 2 cores (a load average of 12): start-up stalls of 5.4-7.7 s, so a 5 s
timeout declared live ranks failed; one rank per core does not stall like that.

MPI only (mpi4py, loaded on first use): no torch, no Lightning.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_mpi.comm.quorum import LEAVE_SHARE, Beacon, Quorum

#: seconds between two calls into MPI from the heartbeat thread (the detector's period is ``>= 0.2 s``
#: at any useful timeout; a call costs microseconds)
BEAT_SECONDS = 0.05
#: the environment variable through which ``mpirun --mca mpi_ft_detector_timeout S`` reaches the ranks
DETECTOR_TIMEOUT_ENV = "OMPI_MCA_mpi_ft_detector_timeout"
DETECTOR_ENV = "OMPI_MCA_mpi_ft_detector"
#: the environment variable through which ``lightning-mpi --freeze-timeout S`` reaches the ranks
FREEZE_TIMEOUT_ENV = "LIGHTNING_MPI_FREEZE_TIMEOUT"
#: seconds a rank may stay stopped (``SIGSTOP``) while its peers go on before it is killed
#: (:mod:`.watchdog`), when ``--freeze-timeout`` did not say (``lightning-mpi``'s default too)
FREEZE_TIMEOUT = 1.0


def detector_timeout(environ: dict[str, str] | None = None) -> float | None:
    """Open MPI's heartbeat timeout for this job (``lightning-mpi --hang-timeout``), or ``None`` when
    the detector is off."""
    env = os.environ if environ is None else environ
    if env.get(DETECTOR_ENV, "").lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        return float(env.get(DETECTOR_TIMEOUT_ENV, "10"))
    except ValueError:
        return None


def freeze_timeout(environ: dict[str, str] | None = None) -> float | None:
    """Seconds a rank may stay stopped while its peers go on before the process beside it kills it
    (``lightning-mpi --freeze-timeout``; :mod:`.watchdog`), or ``None`` when that is off (0)."""
    env = os.environ if environ is None else environ
    try:
        seconds = float(env.get(FREEZE_TIMEOUT_ENV, FREEZE_TIMEOUT))
    except ValueError:
        raise ValueError(
            f"{FREEZE_TIMEOUT_ENV}={env[FREEZE_TIMEOUT_ENV]!r}: must be a number of seconds (0: off); "
            "set it with `lightning-mpi --freeze-timeout S`"
        ) from None
    return seconds if seconds > 0 else None


class Heartbeat:
    """A daemon thread that calls into MPI every :data:`BEAT_SECONDS` (module docstring).

    Started on construction; :meth:`stop` ends it. Needs ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, interval: float = BEAT_SECONDS) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self._comm = MPI.COMM_SELF
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_mpi heartbeat", daemon=True)
        self._thread.start()
        # after every exit handler registered later (the communicators a heal retired, the quorum)
        atexit.register(self.close)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._comm.Iprobe()

    def stop(self) -> None:
        """End the thread (safe to call twice); no MPI call follows."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def close(self) -> None:
        """At exit: end the thread, and finalize MPI at once. mpi4py finalizes it only after the
        interpreter's teardown (seconds with torch loaded, on a busy machine), and meanwhile this
        process would answer no heartbeat: Open MPI's ``MPI_Finalize`` under ULFM waits for every
        rank (a shrink, then a barrier), and the ranks already in it declared a rank still tearing
        down failed, and ended with an error (measured: a fault-free job of 8 ranks at a 4 s
        timeout, ``OPAL ERROR ... ompi_mpi_finalize.c at line 170``, did not end)."""
        from mpi4py import MPI

        self.stop()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()


_HEARTBEAT: list[Heartbeat] = []


def heartbeat() -> Heartbeat | None:
    """This process's :class:`Heartbeat`, started on first use, when Open MPI's detector is on
    (``None`` otherwise). MPI must be initialised."""
    if not _HEARTBEAT:
        if detector_timeout() is None:
            return None
        _HEARTBEAT.append(Heartbeat())
    return _HEARTBEAT[0]


_QUORUM: list[Quorum] = []


def quorum() -> Quorum | None:
    """This process's :class:`~.quorum.Quorum` (a process cut off from most of the run stops before
    Open MPI's detector on its side fires, and a rank stopped while its peers go on is killed:
    :mod:`.watchdog`), started on first use, when Open MPI's detector is on (``None`` otherwise): its
    timeout is :data:`~.quorum.LEAVE_SHARE` of the detector's, its freeze timeout
    :func:`freeze_timeout`'s."""
    if not _QUORUM:
        timeout = detector_timeout()
        if timeout is None:
            return None
        _QUORUM.append(Quorum(LEAVE_SHARE * timeout, freeze_timeout()))
    return _QUORUM[0]


def beacon() -> Beacon | None:
    """Where this process's :func:`quorum` hears beats (``None`` without one)."""
    found = quorum()
    return found.beacon if found is not None else None


def beat_from_mpi_init() -> None:
    """When Open MPI's detector is on in this job, start :func:`heartbeat` as soon as ``mpi4py.MPI``
    is imported (at once if it is already), whoever imports it. Cheap otherwise: one look at the
    environment."""
    if detector_timeout() is None:
        return
    import wrapt  # only in a job with the detector on

    wrapt.register_post_import_hook(lambda _module: heartbeat(), "mpi4py.MPI")


@dataclass(frozen=True)
class Processes:
    """Where every rank of the run lives: ``(host, pid)`` by rank, and where its :func:`quorum`
    hears beats (``None`` without one)."""

    where: tuple[tuple[str, int], ...]
    beacons: tuple[Beacon | None, ...]

    @staticmethod
    def here() -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    @classmethod
    def gather(cls, transport: Any) -> Processes:
        """Collective over ``transport``: every rank's :meth:`here` and :func:`beacon`."""
        everyone = transport.allgather_object((*cls.here(), beacon()))
        return cls(tuple((str(host), int(pid)) for host, pid, _ in everyone), tuple(b for _, _, b in everyone))

    def survivors(self, old_ranks: Sequence[int]) -> Processes:
        """The table of a healed run whose rank ``r`` was rank ``old_ranks[r]`` of this one."""
        return Processes(tuple(self.where[old] for old in old_ranks), tuple(self.beacons[old] for old in old_ranks))

    def kill_lost(self, lost: Sequence[int]) -> list[int]:
        """SIGKILL the ``lost`` ranks that run on this host (not this process); returns their pids.

        Several survivors on one host may kill the same process: a second kill finds it gone."""
        host, me = self.here()
        killed = []
        for rank in lost:
            if not 0 <= rank < len(self.where):
                continue
            where, pid = self.where[rank]
            if where != host or pid == me:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            killed.append(pid)
        return killed
