"""What one run created over MPI (communicators, windows, mailboxes), so that a failed run's can be
abandoned whole and reclaimed by the next run.

A run that failed on some rank cannot release its handles the usual way: freeing a window is a
collective that synchronises, and the failed rank may be far away in its own error handling (or
the others may be). So a failed run's :class:`RunResources` is *abandoned*: every free through it
becomes a no-op (the handles stay referenced here), and waits on its transports raise at once.
The next run reclaims it (:func:`~lightning_mpi.comm.reclaim.reclaim`) on a fresh communicator,
where every rank is known to be present: mailboxes are settled (every message of the failed run is
received, so every send completes and no stale message can match later traffic), windows are freed
in creation order, and communicators are freed.

Requests of nonblocking collectives that a failed run left unmatched can neither complete nor be
freed (the MPI standard forbids ``MPI_Request_free`` on them): they are dropped, which leaves one
small request object inside MPICH per such collective.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

#: communicators and windows made through a :class:`RunResources` and not yet freed, process-wide
_LIVE = {"comms": 0, "windows": 0}

#: requests (with their buffers) of nonblocking operations that a failed run left in flight
_PENDING_FOREVER: list[Any] = []


def keep_pending(request_and_buffers: Any) -> None:
    """Keep a request that a failed run left in flight, and its buffers, for the life of the process.

    The operation may still complete whenever MPI makes progress (the other ranks may have
    started their side of it), and MPI then writes into its buffers: freed memory, if nothing
    held them (a heap corruption seen as ``malloc(): unaligned tcache chunk`` in a later run).
    mpi4py's request holds its buffers, so holding the request is enough; it costs a few bytes
    per failed run.
    """
    _PENDING_FOREVER.append(request_and_buffers)


class TrackedMailbox(Protocol):
    """A run's mailbox as tracked here (:class:`~lightning_mpi.comm.mailbox.Mailbox`): after a
    failed run, :func:`~lightning_mpi.comm.reclaim.reclaim` settles it over a fresh transport."""

    def settle(self, transport: Any) -> None: ...


def live_handles() -> dict[str, int]:
    """How many communicators and windows lightning_mpi made for its runs are still alive (tracked
    ones: every run's, abandoned ones included), for leak checks."""
    return dict(_LIVE)


class RunResources:
    """Every communicator, window and mailbox one run created, in creation order.

    ``serial`` numbers the runs (the same on every rank: runs start together).
    """

    def __init__(self, serial: int = 0) -> None:
        self.serial = serial
        self.abandoned = False
        self.comms: list[Any] = []
        self.windows: list[Any] = []
        self.mailboxes: list[TrackedMailbox] = []
        self._lock = threading.Lock()  # a progress thread may free its communicator while we abandon

    def comm(self, comm: Any) -> Any:
        """Track ``comm`` (made for this run); returns it."""
        with self._lock:
            self.comms.append(comm)
            _LIVE["comms"] += 1
        return comm

    def window(self, win: Any) -> Any:
        """Track ``win`` (made for this run); returns it."""
        with self._lock:
            self.windows.append(win)
            _LIVE["windows"] += 1
        return win

    def mailbox(self, box: TrackedMailbox) -> None:
        """Track ``box`` (made for this run)."""
        with self._lock:
            self.mailboxes.append(box)

    def free_comm(self, comm: Any) -> None:
        """Free ``comm`` now, unless the run was abandoned (then
        :func:`~lightning_mpi.comm.reclaim.reclaim` frees it) or it was freed already."""
        with self._lock:
            if self.abandoned or not _remove(self.comms, comm):
                return
            _LIVE["comms"] -= 1
        comm.Free()

    def free_window(self, win: Any) -> None:
        """Free ``win`` now (collective), unless the run was abandoned."""
        with self._lock:
            if self.abandoned:
                return
            if _remove(self.windows, win):
                _LIVE["windows"] -= 1
        win.Free()

    def forget_mailbox(self, box: TrackedMailbox) -> bool:
        """True if ``box`` may close now; False when the run was abandoned (reclaim settles it)."""
        with self._lock:
            if self.abandoned:
                return False
            _remove(self.mailboxes, box)
            return True

    def abandon(self) -> None:
        """The run failed: from now on nothing it made is freed except by
        :func:`~lightning_mpi.comm.reclaim.reclaim`."""
        with self._lock:
            self.abandoned = True

    def counts(self) -> tuple[int, int, int, int]:
        """``(serial, communicators, windows, mailboxes)``: what the ranks compare before a reclaim."""
        return (self.serial, len(self.comms), len(self.windows), len(self.mailboxes))

    def free_abandoned(self) -> None:
        """Free every window (in creation order: each free synchronises, so every rank must free
        the same ones in the same order) and then every communicator of this abandoned run, and
        forget its mailboxes. Collective; for :func:`~lightning_mpi.comm.reclaim.reclaim`, after
        it settled the mailboxes."""
        if not self.abandoned:
            raise RuntimeError(
                "lightning_mpi: free_abandoned() is for abandoned runs; free a live run's handles one by one"
            )
        with self._lock:
            windows, comms = self.windows, self.comms
            self.comms, self.windows, self.mailboxes = [], [], []
        for win in windows:
            win.Free()
        for comm in comms:
            comm.Free()
        with self._lock:
            _LIVE["windows"] -= len(windows)
            _LIVE["comms"] -= len(comms)


def _remove(items: list[Any], item: Any) -> bool:
    for index, candidate in enumerate(items):
        if candidate is item:
            del items[index]
            return True
    return False
