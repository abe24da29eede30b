"""When a rank fails: its exception propagates, the others raise ``RankFailedError``, and an
exception that nobody handles ends every rank.

Every strategy (any frontend) holds a :class:`RunFailures`: an
:class:`~lightning_mpi.comm.errors.ErrorChannel`, and a fresh
:class:`~lightning_mpi.comm.transport.Transport` for each run, whose waits watch it. When an
exception leaves a run on one rank (:meth:`RunFailures.fail_run`; the Trainer calls it for
everything raised inside ``fit``/``validate``/``test``/``predict``, Fabric for everything raised
inside a strategy call or a :meth:`~RunFailures.propagate_errors` block):

1. the rank posts it on the channel (unless it is itself a ``RankFailedError``) and keeps MPI
   progress going until every other rank acknowledged it (a few seconds at most);
2. the run is abandoned: its transport and everything made over it (communicators, windows,
   mailboxes, requests in flight) are never used or freed by a collective again, the rule's
   threads stop, and the next collective starts a fresh transport, which first reclaims what the
   failed run left (:func:`~lightning_mpi.comm.reclaim.reclaim`);
3. the exception propagates. The other ranks raise ``RankFailedError`` from whatever wait they
   are in, or at their next batch or optimizer step, and go through the same steps.

``abort_on_exception=True`` ends the job instead: the failing rank prints its
traceback and calls ``MPI_Abort`` at once. And whatever the option, an exception that reaches the
top of the program aborts every rank (:func:`install_abort_hook`, as ``python -m mpi4py`` does), so
an unhandled failure still ends the job within seconds.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from lightning_mpi.comm.errors import LINGER_SECONDS, ErrorChannel, RankFailedError, RunStopped
from lightning_mpi.comm.reclaim import reclaim
from lightning_mpi.comm.resources import RunResources
from lightning_mpi.comm.transport import Transport, wait_request
from lightning_mpi.comm.ulfm import mark_failed

#: Pause between printing a failing rank's message and ``MPI_Abort`` (see :func:`abort_every_rank`).
ABORT_FLUSH_SECONDS = 0.5

#: How long a rank that only learnt of another's failure waits before aborting the job itself: the
#: failing rank aborts first, with its own traceback, unless it is busy handling the error.
ABORT_DEFER_SECONDS = LINGER_SECONDS + 3.0


def abort_every_rank(message: str) -> None:
    """Write ``message`` to stderr, then end every rank of the job with ``MPI_Abort`` (no return)."""
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    # mpiexec forwards each rank's output through its proxies asynchronously; Abort makes it
    # kill every proxy at once, which can drop lines still in flight (a CI run lost a traceback
    # this way). A short pause on a path that is ending the job anyway lets them through.
    time.sleep(ABORT_FLUSH_SECONDS)
    mark_failed()  # `lightning-mpi --heal` reports the failure whatever mpirun's exit status says
    from mpi4py import MPI  # initialises MPI on import: only on this path (see lightning_mpi.comm)

    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # not reached: Abort does not return


def install_abort_hook(rank: int, world_size: int) -> None:
    """Make an exception that reaches the top of the program on this rank abort every rank.

    The others may be waiting for this rank, or handling the same failure. Installed once per
    process; an earlier hook (a debugger's, say) still runs first and prints the traceback. A
    ``RankFailedError`` waits :data:`ABORT_DEFER_SECONDS` before it aborts, so that the failing
    rank's own traceback is printed before the job ends.
    """
    previous = sys.excepthook
    if getattr(previous, "_lightning_mpi_abort", False):
        return

    def abort_on_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)  # prints the traceback
        if issubclass(kind, KeyboardInterrupt):
            return
        if issubclass(kind, RunStopped):  # this side of a partition stops; the other may go on
            sys.stderr.write(f"lightning_mpi: rank {rank} stops (traceback above); the job goes on without it.\n")
            sys.stderr.flush()
            mark_failed()
            os._exit(1)
        if issubclass(kind, RankFailedError):
            sys.stderr.flush()
            time.sleep(ABORT_DEFER_SECONDS)
        abort_every_rank(f"lightning_mpi: rank {rank} of {world_size} failed (traceback above); aborting every rank.\n")

    abort_on_uncaught._lightning_mpi_abort = True  # type: ignore[attr-defined]  # a marker: installed once
    sys.excepthook = abort_on_uncaught


#: failed runs' resources, process-wide: a retry may build a new strategy (a new Trainer with
#: ``strategy="mpi_..."``), and the first fresh transport of any strategy reclaims them
_ABANDONED: list[RunResources] = []
_RUN_SERIALS = itertools.count(1)  # runs start together on every rank, so serials agree

#: the error channel, process-wide for the same reason: a message about a failed run may arrive
#: after its strategy is gone, and the channel's generations drop it instead of failing a new run
_CHANNEL: list[ErrorChannel] = []


def error_channel(comm: Any) -> ErrorChannel:
    """The process's error channel over ``comm``'s ranks (made on first use: collective)."""
    if not _CHANNEL:
        _CHANNEL.append(ErrorChannel(comm))
    return _CHANNEL[0]


def agreed_by_every_rank(error: BaseException) -> bool:
    """True for an exception that every rank raises at the same agreed point (a preemption stop):
    no failure, nobody is left waiting, and the run's communicators stay usable."""
    return bool(getattr(error, "agreed_by_every_rank", False))


class RunFailures:
    """The error channel, each run's transport, and what happens when a run fails (module docstring).

    Args:
        comm: the strategy's communicator; each run's transport is a fresh duplicate of it.
        rank, world_size: this rank and the number of ranks.
        collective_timeout: seconds a wait may take (``None``: forever).
        abort_on_exception: ``MPI_Abort`` at once instead of propagating (see ``fail_run``).
        on_abandon: called when a run is abandoned, to drop what was built over its transport
            (the rule's threads, windows and buffers) without a collective.
    """

    def __init__(
        self,
        comm: Any,
        rank: int,
        world_size: int,
        collective_timeout: float | None,
        abort_on_exception: bool,
        on_abandon: Callable[[], None],
    ) -> None:
        self._base_comm = comm  # used only to duplicate each run's communicator from
        self.rank = rank
        self.world_size = world_size
        self._timeout = collective_timeout
        self.abort_on_exception = abort_on_exception
        self._on_abandon = on_abandon
        self.errors = error_channel(comm)  # the first is collective: every rank builds its strategy together
        self._transport: Transport | None = None
        self._pending_dup: tuple[Any, Any] | None = None  # an Idup another rank never joined
        self._handled: BaseException | None = None

    @property
    def timeout(self) -> float | None:
        """Seconds any wait may take (``None``: forever); setting it applies to the current run too."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._timeout = value
        if self._transport is not None:
            self._transport.timeout = value

    # -- each run's transport ------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The current run's transport; the first collective after a failed run starts a fresh one."""
        if self._transport is None:
            self._transport = self._fresh_transport()
            if _ABANDONED:
                _ABANDONED[:] = reclaim(list(_ABANDONED), self._transport)
        return self._transport

    def _fresh_transport(self) -> Transport:
        """A transport over a new duplicate of the strategy's communicator (collective: a watched
        ``Idup``). An ``Idup`` that a failure interrupted is kept and completed by the next call, so
        that every rank starts the same number of them."""
        if self._pending_dup is None:
            self._pending_dup = self._base_comm.Idup()
        comm, request = self._pending_dup
        wait_request(
            request, self._timeout, "starting a run", self.rank, self.world_size, self.errors.check, settle=True
        )
        self._pending_dup = None
        resources = RunResources(next(_RUN_SERIALS))
        transport = Transport(resources.comm(comm), self._timeout, self.errors, resources)
        # The transport outlives the run (a checkpoint saved after fit gathers the rule's state over
        # it): its communicator is freed (locally) once neither the strategy nor a rule holds it.
        weakref.finalize(transport, resources.free_comm, comm).atexit = False
        return transport

    @property
    def base_comm(self) -> Any:
        """The strategy's communicator, which each run's transport duplicates."""
        return self._base_comm

    def adopt(self, run: Any) -> None:
        """Go on with a healed run (:class:`~lightning_mpi.comm.healing.HealedRun`): its base
        communicator, error channel (the process's from now on) and transport; rank and world
        size as it has them (see :mod:`.healing`)."""
        self._base_comm = run.base
        self.errors = run.errors
        _CHANNEL[:] = [run.errors]
        self._transport = run.transport
        self._pending_dup = None
        self.rank = run.transport.rank
        self.world_size = run.transport.size
        self._handled = None

    # -- failures ----------------------------------------------------------------------------------------
    def check_peers(self) -> None:
        """Raise ``RankFailedError`` if another rank failed (one ``Iprobe``); called every batch
        and optimizer step, so that ranks that make no collective (asynchronous rules, loops
        without a step) still stop within a step."""
        if self.world_size > 1:
            self.errors.check()

    def fail_run(self, error: BaseException) -> None:
        """``error`` leaves the current run on this rank: tell the other ranks and abandon the run
        (see the module docstring); the caller re-raises. Once per exception; nothing at world
        size 1, or for an exception every rank raises at an agreed point."""
        if self.world_size == 1 or error is self._handled or agreed_by_every_rank(error):
            return
        self._handled = error
        if not isinstance(error, RankFailedError):
            if self.abort_on_exception and not isinstance(error, KeyboardInterrupt):
                text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
                abort_every_rank(
                    f"lightning_mpi: rank {self.rank} of {self.world_size} failed; aborting every rank.\n{text}"
                )
            self.errors.post(error)  # once per run: a progress thread may have posted it already
        if self.errors.posted is not None:
            self.errors.linger()
        self.abandon_run()

    def abandon_run(self) -> None:
        """Abandon the current run without a collective: its transport, communicators, windows and
        requests are left for the next run to reclaim, and what was built over them is dropped."""
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.resources.abandon()
            _ABANDONED.append(transport.resources)
        self._on_abandon()
        self.errors.next_generation()

    @contextmanager
    def propagate_errors(self) -> Generator[None, None, None]:
        """Run a block whose exceptions fail the run on every rank (Fabric's training loop).

        An exception inside is posted to the other ranks (which raise ``RankFailedError`` from their
        next wait, batch or step), the run is abandoned, and the exception propagates. The next
        ``fabric.setup`` (or collective) starts on fresh communicators::

            for attempt in range(3):
                try:
                    with fabric.strategy.propagate_errors():
                        model, optimizer = fabric.setup(make_model(), make_optimizer())
                        train(fabric, model, optimizer)
                    break
                except Exception as error:  # this rank's own error, or RankFailedError
                    print(f"attempt {attempt} failed: {error}")
        """
        try:
            yield
        except BaseException as error:
            self.fail_run(error)
            raise
