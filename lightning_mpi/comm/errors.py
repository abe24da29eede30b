"""Rank failures: what they are, how a dead rank is recognised, and how one rank's exception
becomes a :class:`RankFailedError` on every other.

The exceptions: :class:`RankFailedError` (another rank failed), its subclass :class:`ProcessFailed`
(ranks died, and the survivors can heal), :class:`AbandonedRunError` (a failed run's object was used
again).

Dead ranks. Under ULFM (:mod:`lightning_mpi.comm.ulfm`, which heals), an operation that involves a
dead rank fails with an ``MPI.Exception`` of class ``MPI_ERR_PROC_FAILED``, ``MPI_ERR_REVOKED`` or
``MPI_ERR_PROC_FAILED_PENDING``: :func:`process_failure` and :func:`failures_raised` turn any of
them into one :class:`ProcessFailed`. A dead rank cannot post its own failure, so the error channel
below reports a dead rank this way instead.

Telling the others. An MPI job has no shared notion of "the run failed": a rank that raises stops calling the
collectives the others wait in. An :class:`ErrorChannel` is a private communicator on which a
failing rank tells every other rank, in one small non-blocking message each, who failed and why.
Every wait loop of lightning_mpi calls :meth:`ErrorChannel.check` (one ``Iprobe``), so a rank
waiting for the failed one raises :class:`RankFailedError` within a poll interval instead of
waiting for ``collective_timeout``.

Generations. A failed run is abandoned on every rank (its communicators and windows are never
used again) and the next run starts a new *generation*. Every message carries the generation it
was posted in, so a message that arrives late, or that nobody read because several ranks failed
at once, is dropped instead of failing the next run. Every rank abandons each failed run once, so
the ranks' generation counters agree.

Lingering. Passive-target RMA aimed at a rank (a parameter-server commit, a decision board read)
completes only while that rank is inside MPI. After posting, the failing rank therefore keeps
driving MPI progress (:meth:`ErrorChannel.linger`) until every other rank acknowledged the error
or ``linger_seconds`` passed, so that a rank blocked in ``Unlock`` against it can finish, reach
its next check and raise.
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lightning_mpi.comm.resources import keep_pending

#: message tags on the channel's private communicator
ERROR_TAG = 1
ACK_TAG = 2

#: seconds a failing rank keeps driving MPI progress while it waits for the acknowledgements
LINGER_SECONDS = 5.0


def describe(error: BaseException) -> str:
    """``"TypeName: message"`` (what the other ranks are told)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class RankFailedError(RuntimeError):
    """Another rank failed, so this rank stopped the run too.

    Attributes:
        rank: the rank that failed.
        error: its exception, as ``"TypeName: message"``; the full traceback is in that rank's
            own output (its stderr).
    """

    def __init__(self, rank: int, error: str) -> None:
        self.rank = rank
        self.error = error
        super().__init__(
            f"lightning_mpi: rank {rank} failed with {error}; this rank stopped too. "
            f"Rank {rank}'s traceback is in its own output."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.error))


class RunStopped(RankFailedError):
    """Too few ranks are left here to go on (a heal's ``min_ranks``): this side of the run stops.
    The ranks on the other side of a partition may hold the majority and go on, so this error ends
    this process alone, never the job (no ``MPI_Abort``). Every rank left on this side raises it at
    the same point (the heal it could not finish), so it is not posted to them."""

    agreed_by_every_rank = True

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(rank, message)
        self.args = (f"lightning_mpi: {message}",)


class AbandonedRunError(RuntimeError):
    """A communicator, window or rule of a run that failed was used again; start a new run
    (a new ``fit``, or ``fabric.setup`` again) instead."""


class ProcessFailed(RankFailedError):
    """Ranks of a communicator died (ULFM reported ``MPI_ERR_PROC_FAILED``, ``MPI_ERR_REVOKED`` or
    ``MPI_ERR_PROC_FAILED_PENDING``); the survivors can heal (:func:`~lightning_mpi.comm.ulfm.heal`).

    Attributes:
        ranks: ranks of the communicator that this process knew to be dead when it raised, in
            increasing order; ``()`` when another survivor noticed first and revoked the
            communicator (:attr:`~lightning_mpi.comm.ulfm.Healed.lost` is the agreed answer).
        where: the operation that failed (``"allreduce"``, ``"progress thread"``, ...).
        error_class: ``"MPI_ERR_PROC_FAILED"``, ``"MPI_ERR_REVOKED"``, ``"MPI_ERR_PROC_FAILED_PENDING"``
            or ``"MPI_ERR_OTHER"`` (from a communicator with a rank known dead: :func:`process_failure`).
        rank: the first of ``ranks``, ``-1`` when none is known (as :class:`RankFailedError`).
    """

    def __init__(self, ranks: Sequence[int] = (), where: str = "", error_class: str = "MPI_ERR_PROC_FAILED") -> None:
        self.ranks = tuple(sorted(ranks))
        self.where = where
        self.error_class = error_class
        super().__init__(self.ranks[0] if self.ranks else -1, error_class)
        who = f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}" if self.ranks else "a rank"
        self.args = (
            f"lightning_mpi: {who} of the communicator died ({error_class}"
            f"{f' in {where}' if where else ''}); the survivors can heal (lightning_mpi.comm.ulfm.heal)",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.ranks, self.where, self.error_class))


# -- dead ranks (ULFM) --------------------------------------------------------------------------------
def _failure_classes() -> dict[int, str]:
    from mpi4py import MPI

    return {
        MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED",
        MPI.ERR_PROC_FAILED_PENDING: "MPI_ERR_PROC_FAILED_PENDING",
        MPI.ERR_REVOKED: "MPI_ERR_REVOKED",
    }


def failed_ranks(comm: Any) -> tuple[int, ...]:
    """Ranks of ``comm`` that this process knows to have died (local: ``Comm.Get_failed``);
    ``()`` when none is known or the MPI cannot say."""
    from mpi4py import MPI

    try:
        failed, group = comm.Get_failed(), comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), group)
        finally:
            failed.Free()
            group.Free()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))


def process_failure(error: BaseException | None, comm: Any = None, where: str = "") -> ProcessFailed | None:
    """``error`` (or an exception it was raised from) as a :class:`ProcessFailed` when it reports a
    dead rank, else ``None``. An ``MPI.Exception`` of class ``MPI_ERR_PROC_FAILED``,
    ``MPI_ERR_PROC_FAILED_PENDING`` or ``MPI_ERR_REVOKED`` becomes one naming ``comm``'s dead
    ranks (when ``comm`` is given and this process knows them); a :class:`ProcessFailed` is
    returned as it is. Walks ``__cause__`` / ``__context__``, so an MPI error that a library
    wrapped is still recognised.

    ``MPI_ERR_OTHER`` from an operation on a ``comm`` with a rank known dead is one too: Open MPI's
    non-blocking collectives (libnbc) fail a schedule that meets a dead peer with its generic error
    ("Error in NBC_Start_round", ``MPI_ERR_OTHER``) instead of a failure class (measured: a rank of
    the healthy side of a partition, 8 ranks, got it from ``Request.Test`` of a barrier)."""
    seen: set[int] = set()
    mpi = sys.modules.get("mpi4py.MPI")  # no MPI loaded: no MPI error
    classes = _failure_classes() if mpi is not None else {}
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ProcessFailed):
            return error
        get_class = getattr(error, "Get_error_class", None)
        if classes and get_class is not None:
            code = get_class()
            error_class = classes.get(code)
            if error_class is not None:
                return ProcessFailed(failed_ranks(comm) if comm is not None else (), where, error_class)
            if mpi is not None and comm is not None and code == mpi.ERR_OTHER:
                dead = failed_ranks(comm)
                if dead:
                    return ProcessFailed(dead, where, "MPI_ERR_OTHER")
        error = error.__cause__ or error.__context__
    return None


@contextmanager
def failures_raised(comm: Any = None, where: str = "") -> Iterator[None]:
    """Inside, an MPI error that reports a dead rank raises :class:`ProcessFailed` instead (from
    the MPI error); other exceptions pass unchanged::

        with failures_raised(comm, "allreduce"):
            comm.Allreduce(MPI.IN_PLACE, x)
    """
    try:
        yield
    except ProcessFailed:
        raise
    except Exception as error:
        failed = process_failure(error, comm, where)
        if failed is None:
            raise
        raise failed from error


class ErrorChannel:
    """Tells every rank of ``comm`` that one failed (module docstring).

    Collective: construction (it duplicates ``comm``). Everything else is local and non-blocking
    except :meth:`linger`, which waits a bounded time.

    Args:
        comm: the communicator whose ranks run together (it is duplicated).
        linger_seconds: how long :meth:`linger` waits for the acknowledgements at most.
    """

    def __init__(self, comm: Any, linger_seconds: float = LINGER_SECONDS) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.MPI = MPI
        self.comm = comm.Dup()
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.linger_seconds = linger_seconds
        self.generation = 0
        self._lock = threading.RLock()  # a progress thread may post while the main thread checks
        self._sends: list[tuple[Any, bytes]] = []  # (request, payload) until the send completes
        self._failure: RankFailedError | None = None  # this generation's failure, once known
        self._thread_error: BaseException | None = None  # a background thread's, for the main thread
        self._posted: BaseException | None = None  # what this rank posted in this generation
        self._acks: set[int] = set()

    # -- the failing rank ------------------------------------------------------------------------
    def post(self, error: BaseException) -> None:
        """This rank failed with ``error``: tell every other rank (non-blocking). Once per generation;
        from then on every :meth:`check` of this rank raises too."""
        if process_failure(error) is not None:
            return  # a dead rank (ULFM): every survivor learns it from MPI, and the dead cannot be told
        with self._lock:
            if self._posted is not None:
                return
            self._posted = error
            if self._failure is None:
                self._failure = RankFailedError(self.rank, describe(error))
            payload = pickle.dumps((self.generation, self.rank, describe(error)))
            for dest in range(self.size):
                if dest != self.rank:
                    self._sends.append((self.comm.Isend(payload, dest=dest, tag=ERROR_TAG), payload))

    def post_from_thread(self, error: BaseException) -> None:
        """A background thread of this rank failed: post ``error``, and make this rank's main thread
        raise that same exception at its next :meth:`check`."""
        with self._lock:
            if self._thread_error is None:
                self._thread_error = error
        self.post(error)

    @property
    def posted(self) -> BaseException | None:
        """What this rank posted in this generation (``None``: nothing)."""
        return self._posted

    def linger(self) -> None:
        """Drive MPI progress until every other rank acknowledged this rank's error, or for
        ``linger_seconds`` at most (module docstring). Errors other ranks post meanwhile count as
        acknowledgements (they stopped too) and are acknowledged in turn."""
        deadline = time.monotonic() + self.linger_seconds
        while time.monotonic() < deadline and len(self._acks) < self.size - 1:
            self._receive_all(raise_failure=False)
            time.sleep(0.001)
        self._reap()

    # -- every rank ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if this run failed: a background thread's own exception, else
        :class:`RankFailedError` naming the rank that failed. One ``Iprobe`` when nothing did."""
        if self._thread_error is not None:
            error, self._thread_error = self._thread_error, None
            raise error
        if self._failure is not None:
            raise self._copy_of_failure()
        self._receive_all(raise_failure=True)

    @property
    def failure(self) -> RankFailedError | None:
        """This generation's failure, once this rank knows of one."""
        return self._failure

    def next_generation(self) -> None:
        """The failed run is abandoned on this rank: forget its failure; late messages about it are
        dropped from now on."""
        with self._lock:
            self._reap()
            self.generation += 1
            self._failure = None
            self._thread_error = None
            self._posted = None
            self._acks = set()

    def close(self, release: Callable[[Any], None] | None = None) -> None:
        """Free the communicator (local; messages still in flight are abandoned), or hand it to
        ``release`` instead (:func:`~.ulfm.retire`, after a heal). A send still in flight (to a rank
        that died, or is cut off) is kept for the life of the process
        (:func:`~.resources.keep_pending`): a request dropped here would be freed by mpi4py, and
        Open MPI aborts the process when a freed send fails later ("Send error after request
        freed", ``MPI_ERRORS_ARE_FATAL`` on ``COMM_NULL``: seen on a rank of the side that went on
        in an 8-rank partition)."""
        with self._lock:
            self._reap()
            for pending in self._sends:
                keep_pending(pending)
            self._sends = []
        if self.comm is not None:
            if release is None:
                self.comm.Free()
            else:
                release(self.comm)
            self.comm = None

    # -- internals ---------------------------------------------------------------------------------
    def _copy_of_failure(self) -> RankFailedError:
        # a fresh exception per raise: re-raising one object would chain every traceback onto it
        assert self._failure is not None
        return RankFailedError(self._failure.rank, self._failure.error)

    def _probe(self, status: Any, raise_failure: bool) -> bool:
        """``Iprobe`` for any message; under ULFM a dead rank raises :class:`ProcessFailed` (or, while
        lingering, ends the probing)."""
        try:
            return self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG, status=status)
        except self.MPI.Exception as error:
            failed = process_failure(error, self.comm, "the error channel")
            if failed is None:
                raise
            if raise_failure:
                raise failed from error
            return False

    def _receive_all(self, raise_failure: bool) -> None:
        status = self.MPI.Status()
        while self._probe(status, raise_failure):
            source, tag = status.Get_source(), status.Get_tag()
            payload = bytearray(status.Get_count(self.MPI.BYTE))
            self.comm.Recv([payload, self.MPI.BYTE], source=source, tag=tag)
            generation, *rest = pickle.loads(payload)
            if generation < self.generation:
                continue  # about a run this rank has already abandoned
            if tag == ACK_TAG:
                self._acks.add(source)
                continue
            rank, error = rest
            with self._lock:
                self._sends.append(
                    (self.comm.Isend(pickle.dumps((generation, self.rank)), dest=source, tag=ACK_TAG), b"")
                )
                self._acks.add(source)  # it failed too: it waits for nobody
                if self._failure is None:
                    self._failure = RankFailedError(rank, error)
            if raise_failure:
                raise self._copy_of_failure()
        self._reap()

    def _reap(self) -> None:  # the sends that are over
        with self._lock:
            self._sends = [(r, p) for r, p in self._sends if not _completed(r)]


def _completed(request: Any) -> bool:
    """Whether a send is over: done, or ended with an error (its peer died; such a request is no
    longer in flight, and the failure is found where it matters, by the next operation)."""
    try:
        return bool(request.Test())
    except Exception:  # noqa: BLE001  (an MPI error: the send ended)
        return True
