"""The progress thread: enters MPI while the training thread computes, so that transfers move.

MPICH moves data only while some thread of the process is inside an MPI call, and training
spends most of its time in torch kernels that make none. Two things need that movement:

- non-blocking collectives in flight during backward (the synchronous rules): the thread calls
  :meth:`~lightning_mpi.comm.engine.ExchangeScheduler.try_poll`, which tests every request and starts an
  exchange's next phase (ASA's sum and Allgather) as soon as its previous one completed;
- one-sided operations aimed at this rank (the parameter-server windows): the thread calls
  ``Iprobe`` on a private communicator (:meth:`ProgressThread.probing`). A 16 MB
  ``Lock/Accumulate/Unlock`` against a busy rank took 27 ms with it instead of about 2,000 ms.

Torch kernels release the GIL and the thread sleeps between calls, so it costs little; while
paused it blocks on an event and costs nothing. Calling MPI from a second thread needs
``MPI_THREAD_MULTIPLE`` (:func:`require_thread_multiple`).

A poll that raises stops the thread and hands the exception to ``on_error`` (the strategies post
it on the run's :class:`~lightning_mpi.comm.errors.ErrorChannel`: the other ranks raise
``RankFailedError``, and this rank's training thread raises the thread's own exception at its
next wait).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_mpi.comm.errors import failures_raised
from lightning_mpi.comm.resources import RunResources


def require_thread_multiple(who: str, remedy: str = "") -> None:
    """Raise ``RuntimeError`` unless MPI runs with ``MPI_THREAD_MULTIPLE`` (a progress thread needs it).

    ``who`` names what needs the thread in the message; ``remedy`` adds a way around it."""
    from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        names = {
            MPI.THREAD_SINGLE: "THREAD_SINGLE",
            MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
            MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED",
        }
        raise RuntimeError(
            f"lightning_mpi: {who} needs MPI_THREAD_MULTIPLE for its progress thread (which calls MPI while "
            f"training runs), but MPI was initialised with {names.get(level, level)}. Do not set "
            f"mpi4py.rc.thread_level (its default is 'multiple'), and use an MPI library built with thread "
            f"support{remedy}."
        )


class ProgressThread:
    """A daemon thread that calls ``poll()`` every ``interval`` seconds while it runs.

    Args:
        poll: the MPI call to make.
        interval: seconds to sleep between calls.
        who: what needs the thread, for the ``MPI_THREAD_MULTIPLE`` error and the thread's name.
        running: start polling at once (else at :meth:`start`).
        on_close: called once after the thread has stopped (e.g. to free its communicator).
        on_error: called (in the thread) with the exception when ``poll`` raises; the thread then
            stops polling. The exception is also kept in :attr:`error`.

    Raises:
        RuntimeError: MPI does not run with ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(
        self,
        poll: Callable[[], Any],
        interval: float,
        who: str,
        running: bool = True,
        on_close: Callable[[], None] | None = None,
        remedy: str = "",
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        require_thread_multiple(who, remedy)
        self.interval = interval
        self._poll = poll
        self._on_close = on_close
        self._on_error = on_error
        self.error: BaseException | None = None
        self._running = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"lightning_mpi-progress ({who})", daemon=True)
        self._thread.start()
        if running:
            self.start()

    @classmethod
    def probing(
        cls,
        comm: Any,
        interval: float,
        who: str,
        resources: RunResources | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> ProgressThread:
        """A running thread that calls ``Iprobe`` on a private duplicate of ``comm`` (collective:
        the duplication, blocking), which services one-sided operations aimed at this rank.
        :meth:`close` frees the duplicate (through ``resources``, a
        :class:`~lightning_mpi.comm.resources.RunResources`, when given)."""
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        private = comm.Dup()
        if resources is not None:
            resources.comm(private)
            free = lambda: resources.free_comm(private)  # noqa: E731
        else:
            free = private.Free

        def probe() -> Any:
            # Under ULFM a dead rank fails the any-source probe: raised as ProcessFailed.
            with failures_raised(private, f"a progress thread ({who})"):
                return private.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)

        return cls(probe, interval, who, on_close=free, on_error=on_error)

    def _run(self) -> None:
        while True:
            self._running.wait()
            if self._closing:
                return
            try:
                self._poll()
            except BaseException as error:  # noqa: BLE001  handed to on_error, not swallowed
                self.error = error
                self._running.clear()
                if self._on_error is not None:
                    self._on_error(error)
                self._running.wait()  # until close()
                return
            time.sleep(self.interval)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        """Poll from now on."""
        self._running.set()

    def pause(self) -> None:
        """Stop polling (the thread blocks until :meth:`start`)."""
        self._running.clear()

    def close(self) -> None:
        """Stop and join the thread, then run ``on_close`` (safe to call twice)."""
        if self._thread.is_alive():
            self._closing = True
            self._running.set()
            self._thread.join()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()
