"""Non-blocking exchanges as generators, and a tiny scheduler that drives them.

An exchange (the ones in :mod:`lightning_mpi.comm.collectives`) is written as straight-line code
that ``yield``s an MPI request wherever it must wait (``yield from transport.ialltoall(...)``).
:class:`ExchangeScheduler` keeps many such exchanges in flight and advances each as its request
completes. That gives overlap and pipelining for free:

- overlap with backward: gradient hooks start a bucket's exchange and call
  :meth:`ExchangeScheduler.poll`;
- pipelined ASA: segment k+1 is cast and its Alltoall started while segment k is on the wire, and
  segment k is summed while k+1 travels.

MPICH advances a non-blocking collective only while the process is inside an MPI call
(measured: 1,169 ms without, 595 ms with occasional ``Test``), so callers poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any

from lightning_mpi.comm.errors import failures_raised
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.resources import keep_pending
from lightning_mpi.comm.transport import Transport, wait_request

Exchange = Generator[Any, None, Any]


class ExchangeScheduler:
    """Drives exchanges: each is a generator yielding MPI requests; finished ones are dropped.

    Thread-safe: the training thread starts, polls and waits, and a
    :class:`~lightning_mpi.comm.progress.ProgressThread` may poll too (:meth:`try_poll`), so that an
    exchange moves to its next phase (the sum and Allgather after ASA's Alltoall) while backward
    keeps the training thread busy. A re-entrant lock serialises the generators' steps (an exchange
    may start another).
    """

    def __init__(
        self,
        timeout: float | None = None,
        rank: int = 0,
        size: int = 1,
        watch: Callable[[], None] | None = None,
        on_driver_error: Callable[[BaseException], None] | None = None,
        comm: Any = None,
    ) -> None:
        self._active: list[tuple[Exchange, Any]] = []
        # the communicator the exchanges run on: an MPI error there is a lost rank when it has one
        # known dead (libnbc's MPI_ERR_OTHER: :func:`~lightning_mpi.comm.errors.process_failure`)
        self._comm = comm
        self.timeout = timeout  # seconds one request may take before CollectiveTimeout
        self._where = (rank, size)
        self._watch = watch  # raises when another rank failed (every wait calls it)
        self._on_driver_error = on_driver_error  # told at once when the driver thread fails
        self._lock = threading.RLock()
        self._error: BaseException | None = None  # raised in the driver thread, re-raised here

    def start(self, exchange: Exchange) -> None:
        """Run ``exchange`` up to its first wait and keep it in flight."""
        with self._lock:
            self._raise_driver_error()
            self._advance(exchange)

    def _raise_driver_error(self) -> None:
        """An exchange step failed in the driver thread: fail here, in the training thread."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _advance(self, exchange: Exchange) -> None:
        try:
            request = next(exchange)
        except StopIteration:
            return
        self._active.append((exchange, request))

    def poll(self) -> None:
        """Test every request once (this is what moves MPICH's progress engine); advance finished ones."""
        with self._lock:
            self._raise_driver_error()
            self._poll()

    def try_poll(self, on_idle: Callable[[], None] | None = None) -> None:
        """For the driver thread: :meth:`poll` unless another thread holds the engine right now.

        ``on_idle``, when given, runs (under the engine's lock) when nothing is left in flight
        after the poll: a driver pauses itself there, and since :meth:`start` takes the same lock,
        a training thread that starts an exchange and then the driver cannot be overtaken by it.

        Never raises: an error is kept and raised in the training thread's next call, and handed
        to ``on_driver_error`` at once (the strategies post it to the other ranks)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._error is None:
                self._poll()
            if on_idle is not None and not self._active:
                on_idle()
        except BaseException as error:  # noqa: BLE001  handed over, not swallowed
            self._error = error
            if self._on_driver_error is not None:
                self._on_driver_error(error)
        finally:
            self._lock.release()

    def _poll(self) -> None:
        active, self._active = self._active, []
        for i, (exchange, request) in enumerate(active):
            try:
                # a dead rank (ULFM) raises ProcessFailed, as a wait reports it: a gradient hook
                # that polls leaves that one to the exchange, which heals (a bare MPI error escaped
                # the hook and aborted a run that could heal)
                with failures_raised(self._comm, "gradient exchange"):
                    if request.Test():
                        self._advance(exchange)
                    else:
                        self._active.append((exchange, request))
            except BaseException:
                self._active.extend(active[i + 1 :])  # the others stay in flight
                raise

    def wait_all(self, between: Callable[[], None] | None = None) -> None:
        """Block until every exchange has finished, oldest first (waiting progresses all of them).

        ``between()``, when given, runs after each completed wait: work on results that are
        already in (unpacking a finished bucket) then overlaps the transfers still in flight.
        """
        while True:
            with self._lock:
                self._raise_driver_error()
                if not self._active:
                    return
                exchange, request = self._active.pop(0)
            # Waited on outside the lock: the driver thread keeps advancing the others meanwhile.
            wait_request(request, self.timeout, "gradient exchange", *self._where, watch=self._watch, comm=self._comm)
            with self._lock:
                self._advance(exchange)
                self._poll()
            if between is not None:
                between()

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Block until ``done()`` holds or nothing is in flight, waiting on the oldest request first
        (a bounded pool of buffers waits here for one to come back)."""
        while not done():
            with self._lock:
                self._raise_driver_error()
                if not self._active:
                    return
                exchange, request = self._active.pop(0)
            wait_request(request, self.timeout, "gradient exchange", *self._where, watch=self._watch, comm=self._comm)
            with self._lock:
                self._advance(exchange)
                self._poll()

    def abandon(self) -> None:
        """Forget every exchange in flight without waiting (the run failed). They are kept with their
        buffers, not dropped: the other ranks may have joined them, and MPI may still complete them
        (into those buffers) at any later progress."""
        with self._lock:
            keep_pending(self._active)
            self._active = []
            self._error = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._active)


def watched_scheduler(
    transport: Transport, progress_thread: bool, who: str, remedy: str
) -> tuple[ExchangeScheduler, ProgressThread | None]:
    """An :class:`ExchangeScheduler` over ``transport`` that raises when another rank failed and is
    told at once when its driver fails, and, with ``progress_thread`` on more than one rank, a
    paused :class:`~lightning_mpi.comm.progress.ProgressThread` that polls it every 0.2 ms (start it
    while exchanges are in flight); the thread's failure is reported on ``transport``. ``who`` and
    ``remedy`` name the option in the ``MPI_THREAD_MULTIPLE`` error."""
    scheduler = ExchangeScheduler(
        transport.timeout,
        transport.rank,
        transport.size,
        watch=transport.watch,
        on_driver_error=transport.report_thread_failure,
        comm=transport.comm,
    )
    if not progress_thread or transport.size <= 1:
        return scheduler, None
    driver = ProgressThread(
        scheduler.try_poll, 2e-4, who, running=False, remedy=remedy, on_error=transport.report_thread_failure
    )
    return scheduler, driver
