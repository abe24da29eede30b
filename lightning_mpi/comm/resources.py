"""What one run created over MPI (communicators, windows, mailboxes), so that a failed run's can be
abandoned whole and reclaimed by the next run.

A run that failed on some rank cannot release its handles the usual way: freeing a window is a
collective that synchronises, and the failed rank may be far away in its own error handling (or
the others may be). So a failed run's :class:`RunResources` is *abandoned*: every free through it
becomes a no-op (the handles stay referenced here), and waits on its transports raise at once.
The next run reclaims it (:func:`reclaim`) on a fresh communicator, where every rank is known to
be present: mailboxes are settled (every message of the failed run is received, so every send
completes and no stale message can match later traffic), windows are freed in creation order, and
communicators are freed.

Requests of nonblocking collectives that a failed run left unmatched can neither complete nor be
freed (the MPI standard forbids ``MPI_Request_free`` on them): they are dropped, which leaves one
small request object inside MPICH per such collective.
"""
from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_mpi.comm.mailbox import Mailbox
    from lightning_mpi.comm.transport import Transport


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
        self.mailboxes: list["Mailbox"] = []
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

    def mailbox(self, box: "Mailbox") -> None:
        with self._lock:
            self.mailboxes.append(box)

    def free_comm(self, comm: Any) -> None:
        """Free ``comm`` now, unless the run was abandoned (then :func:`reclaim` frees it) or it
        was freed already."""
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

    def forget_mailbox(self, box: "Mailbox") -> bool:
        """True if ``box`` may close now; False when the run was abandoned (reclaim settles it)."""
        with self._lock:
            if self.abandoned:
                return False
            _remove(self.mailboxes, box)
            return True

    def abandon(self) -> None:
        """The run failed: from now on nothing it made is freed except by :func:`reclaim`."""
        with self._lock:
            self.abandoned = True

    def counts(self) -> tuple[int, int, int, int]:
        return (self.serial, len(self.comms), len(self.windows), len(self.mailboxes))


def _remove(items: list[Any], item: Any) -> bool:
    for index, candidate in enumerate(items):
        if candidate is item:
            del items[index]
            return True
    return False


def reclaim(abandoned: list[RunResources], transport: "Transport") -> list[RunResources]:
    """Release what failed runs left, collectively over ``transport`` (a fresh, healthy one);
    returns what could not be released safely (kept referenced).

    Every rank must call it with its own list of the same failed runs. The ranks first agree on
    that (serials and counts): a rank whose list differs would free windows the others do not,
    and a window's free waits for every rank, so on any difference nothing is freed.
    """
    if not abandoned:
        return []
    mine = [run.counts() for run in abandoned]
    if any(theirs != mine for theirs in transport.agree(mine)):
        warnings.warn(
            "lightning_mpi: the ranks abandoned different failed runs, so their communicators and windows "
            "are kept instead of freed (a few MB at most).",
            RuntimeWarning,
        )
        return abandoned
    for run in abandoned:
        for box in run.mailboxes:
            box.settle(transport)
        for win in run.windows:  # creation order, the same on every rank; each free synchronises
            win.Free()
        for comm in run.comms:
            comm.Free()
        _LIVE["windows"] -= len(run.windows)
        _LIVE["comms"] -= len(run.comms)
        run.comms, run.windows, run.mailboxes = [], [], []
    return []
