"""One-sided MPI helpers: a sharded center variable, a clock, a decision board.

Why one-sided, and why this exact recipe (measured): a rank that
computes in Python makes no MPI calls, and MPICH advances passive-target RMA aimed at a rank only
while that rank is inside MPI. With memory from ``MPI.Win.Allocate`` plus a light thread per rank
that calls ``Iprobe`` every ``interval`` seconds, a 16 MB ``Lock(SHARED)/Accumulate/Unlock``
against a busy rank took 27 ms instead of about 2,000 ms (``Win.Create`` memory did not benefit
over shared memory). So every window here is ``Win.Allocate``d, and every rank that hosts part of
one runs a :meth:`~lightning_mpi.comm.progress.ProgressThread.probing` thread for as long as the
window lives.

One-sided serving vs a service thread (``benchmarks/ps_serving.py``, 2 ranks,
4 MiB commits while the host computes, on a 2-core machine shared with other jobs, load ~10):

| design | host busy in pure Python (holds the GIL) | host busy in torch (releases it) |
|---|---|---|
| one-sided: ``Win.Allocate`` + ``Iprobe`` thread | median 34 ms, p90 43 ms | 12 ms, p90 15 ms |
| service thread: ``Recv`` on a dup'd comm + numpy add | median 12 ms, p90 59 ms | 24 ms, p90 30 ms |

Neither wins outright at this load; we keep one-sided because (1) the sum is applied inside MPI
(``Accumulate``), so no commit waits for the host's GIL to run an add, which is what makes the
service thread's tail long while the host runs Python; (2) MPI's accumulate atomicity gives "no
lost update" and torn-free pulls by construction, where a service thread needs its own lock and
request protocol (pull = request + reply, two messages); (3) every rank serves its shard with the
same code path and no rank dedicates a thread to serving, only a cheap ``Iprobe`` loop.

Every access goes through atomic RMA operations (``Accumulate``, ``Get_accumulate`` with
``SUM`` or ``NO_OP``, ``Fetch_and_op``), never plain ``Put``/``Get``: MPI guarantees element-wise
atomicity only between accumulate-family operations, so concurrent commits are never lost and a
pull never reads a half-written element.

No Lightning here; torch tensors are moved through numpy views of the window memory.

A known cost of MPICH 5.0.2 (the ``mpich`` wheel, ch4:ucx and ch4:ofi alike): every *remote*
``MPI_Accumulate``/``MPI_Get_accumulate`` with a real op into ``Win_allocate`` memory leaks 128
bytes inside MPI (reads with ``NO_OP``, ``Fetch_and_op``, ``Put`` and ``Win_create`` windows do
not; reproduced in plain C). Through torch's allocator around it, RSS grows by ~130-400 bytes per
commit and peer. :attr:`ShardedVector.remote_accumulates` counts those operations so that memory
tests can tell that growth from a leak of ours.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_mpi.comm.resources import RunResources

_NP = {torch.float32: np.float32, torch.float64: np.float64}


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s shard of a ``numel``-vector; ``numel`` must divide by ``world``."""
    if numel % world:
        raise ValueError(f"numel={numel} must be a multiple of the world size {world} (pad the buffer)")
    size = numel // world
    return rank * size, (rank + 1) * size


class ShardedVector:
    """A flat vector split over all ranks of ``comm``: rank r hosts elements ``[r·n/W, (r+1)·n/W)``.

    Collective: construction (``Win.Allocate``) and :meth:`free`. Everything else is one-sided and
    may be called by any rank at any time. Traffic per full read or commit is ``n`` elements spread
    evenly over the W hosts, so no rank is a bottleneck and none sits idle as a server.

    Args:
        comm: the communicator (it is duplicated).
        numel: total length, a multiple of ``comm.size``.
        dtype: ``torch.float32`` or ``torch.float64``.
        resources: the run's :class:`~lightning_mpi.comm.resources.RunResources`, which tracks the
            communicator and window (a failed run's are freed by the next run, not by :meth:`free`).
    """

    def __init__(
        self, comm: Any, numel: int, dtype: torch.dtype = torch.float32, resources: RunResources | None = None
    ) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.MPI = MPI
        self.resources = resources if resources is not None else RunResources()
        self.comm = self.resources.comm(comm.Dup())
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.numel = numel
        self.dtype = dtype
        self.np_dtype = _NP[dtype]
        self.shard = numel // self.size
        shard_bounds(numel, self.size, self.rank)
        itemsize = np.dtype(self.np_dtype).itemsize
        self.win = self.resources.window(MPI.Win.Allocate(self.shard * itemsize, itemsize, comm=self.comm))
        # this rank's shard, a view of the window's memory (dropped before the window is freed)
        self.local: np.ndarray | None = np.frombuffer(self.win.tomemory(), dtype=self.np_dtype, count=self.shard)
        self.bytes_sent = 0
        self.wait_seconds = 0.0
        self.remote_accumulates = 0  # accumulate-with-op calls aimed at other ranks (see module docs)

    def _np(self, tensor: Tensor) -> np.ndarray:
        if tensor.dtype != self.dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"expected a contiguous CPU {self.dtype} tensor, got {tensor.dtype} on {tensor.device}")
        return tensor.numpy()

    def _each_shard(self, op, *tensors: Tensor) -> None:
        arrays = [self._np(t) for t in tensors]
        start = time.perf_counter()
        # Start with this rank's own shard's successor so that W ranks committing at once do not
        # all queue on rank 0 first.
        for k in range(self.size):
            target = (self.rank + 1 + k) % self.size
            lo, hi = target * self.shard, (target + 1) * self.shard
            self.win.Lock(target, self.MPI.LOCK_SHARED)
            op(target, *[a[lo:hi] for a in arrays])
            self.win.Unlock(target)
        self.wait_seconds += time.perf_counter() - start

    def init_local(self, full: Tensor) -> None:
        """Set this rank's shard from ``full`` (local store under an exclusive lock). Follow with a barrier."""
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        assert self.local is not None, "init_local() after free()"
        self.win.Lock(self.rank, self.MPI.LOCK_EXCLUSIVE)
        self.local[:] = self._np(full)[lo:hi]
        self.win.Unlock(self.rank)

    def read(self, out: Tensor) -> Tensor:
        """Atomically read the whole vector into ``out`` (``Get_accumulate`` with ``NO_OP``)."""
        mpi_type = self.MPI.FLOAT if self.np_dtype is np.float32 else self.MPI.DOUBLE

        def get(target: int, o: np.ndarray) -> None:
            # NO_OP ignores the origin, but the target extent must be spelled out.
            self.win.Get_accumulate(o, o, target, target=[0, o.size, mpi_type], op=self.MPI.NO_OP)

        self._each_shard(get, out)
        return out

    def add(self, delta: Tensor, old: Tensor | None = None) -> None:
        """Atomically add ``delta`` into the vector; with ``old``, also fetch the values just before the add."""
        self.bytes_sent += delta.numel() * delta.element_size()
        self.remote_accumulates += self.size - 1
        if old is None:
            self._each_shard(lambda target, d: self.win.Accumulate(d, target, op=self.MPI.SUM), delta)
        else:
            self._each_shard(lambda target, d, o: self.win.Get_accumulate(d, o, target, op=self.MPI.SUM), delta, old)

    def free(self) -> None:
        """Collective: release the window and the communicator (after a failed run: leave them to
        the next run). Safe to call twice."""
        if self.win is not None:
            self.local = None
            self.resources.free_window(self.win)
            self.win = None
            self.resources.free_comm(self.comm)


class Counters:
    """``length`` int64 counters hosted on rank ``root``, updated with ``Fetch_and_op`` / ``Accumulate``.

    Used for the server clock (one counter: commits so far) and for the decision board (sticky
    flags raised with ``MAX``). Collective: construction and :meth:`free`. ``resources``: as for
    :class:`ShardedVector`.
    """

    def __init__(self, comm: Any, length: int, root: int = 0, resources: RunResources | None = None) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.MPI = MPI
        self.resources = resources if resources is not None else RunResources()
        self.comm = self.resources.comm(comm.Dup())
        self.root = root
        self.length = length
        self.rank = self.comm.Get_rank()
        hosted = length if self.rank == root else 0
        self.win = self.resources.window(MPI.Win.Allocate(hosted * 8, 8, comm=self.comm))
        if hosted:
            self.win.Lock(root, MPI.LOCK_EXCLUSIVE)
            np.frombuffer(self.win.tomemory(), dtype=np.int64, count=length)[:] = 0
            self.win.Unlock(root)
        self.comm.Barrier()

    def fetch_add(self, index: int, value: int) -> int:
        """Atomically add ``value`` to counter ``index``; return its value before."""
        one = np.array([value], dtype=np.int64)
        old = np.zeros(1, dtype=np.int64)
        self.win.Lock(self.root, self.MPI.LOCK_SHARED)
        self.win.Fetch_and_op([one, 1, self.MPI.INT64_T], [old, 1, self.MPI.INT64_T], self.root, index, self.MPI.SUM)
        self.win.Unlock(self.root)
        return int(old[0])

    def compare_and_swap(self, index: int, expected: int, value: int) -> int:
        """Atomically set counter ``index`` to ``value`` if it holds ``expected``; return what it held."""
        new = np.array([value], dtype=np.int64)
        compare = np.array([expected], dtype=np.int64)
        old = np.zeros(1, dtype=np.int64)
        self.win.Lock(self.root, self.MPI.LOCK_SHARED)
        self.win.Compare_and_swap(
            [new, 1, self.MPI.INT64_T], [compare, 1, self.MPI.INT64_T], [old, 1, self.MPI.INT64_T], self.root, index
        )
        self.win.Unlock(self.root)
        return int(old[0])

    def raise_to(self, index: int, value: int) -> None:
        """Atomically set counter ``index`` to ``max(current, value)`` (a sticky flag)."""
        v = np.array([value], dtype=np.int64)
        self.win.Lock(self.root, self.MPI.LOCK_SHARED)
        self.win.Accumulate([v, 1, self.MPI.INT64_T], self.root, target=[index, 1, self.MPI.INT64_T], op=self.MPI.MAX)
        self.win.Unlock(self.root)

    def set_all(self, values: np.ndarray) -> None:
        """Overwrite every counter (atomically per element, ``REPLACE``)."""
        v = np.ascontiguousarray(values, dtype=np.int64)
        self.win.Lock(self.root, self.MPI.LOCK_SHARED)
        self.win.Accumulate(
            [v, v.size, self.MPI.INT64_T], self.root, target=[0, v.size, self.MPI.INT64_T], op=self.MPI.REPLACE
        )
        self.win.Unlock(self.root)

    def read(self) -> np.ndarray:
        out = np.zeros(self.length, dtype=np.int64)
        self.win.Lock(self.root, self.MPI.LOCK_SHARED)
        self.win.Get_accumulate(
            [out, self.length, self.MPI.INT64_T],
            [out, self.length, self.MPI.INT64_T],
            self.root,
            target=[0, self.length, self.MPI.INT64_T],
            op=self.MPI.NO_OP,
        )
        self.win.Unlock(self.root)
        return out

    def hosted(self) -> np.ndarray | None:
        """A copy of the counters read straight from this rank's window memory, without a lock, on
        the root (``None`` elsewhere): for a run whose other ranks no longer touch it (a heal)."""
        if self.win is None or self.rank != self.root:
            return None
        return np.frombuffer(self.win.tomemory(), dtype=np.int64, count=self.length).copy()

    def free(self) -> None:
        if self.win is not None:
            self.resources.free_window(self.win)
            self.win = None
            self.resources.free_comm(self.comm)


class DecisionBoard:
    """Stop decisions taken without a barrier per step: every rank stops with the same collectives
    behind it, each at its own pace.

    Lightning asks the same bool questions at the same points of every rank's loop (the ``Timer``
    after every batch, ``EarlyStopping`` after validation); the caller numbers them (``index``: 0,
    1, 2, ... on every rank alike), says how many collectives it has run (``count``) and where in
    its loop it asks (``site``: a 32-bit code of the call path, the same at the same point of every
    rank's loop). A rank that
    wants to stop publishes a request on rank 0 (slot ``2 + r``: :data:`STOP` for a ``broadcast``
    from its source, :data:`VOTE` for its own decision in a reduction); rank 0 decides at each of its
    own questions (any stop request; all or any votes).

    The stop is found with a lease (slot 0), so that nobody waits for anybody: a rank answers the
    questions below its lease without touching the board, and at its lease (at most every
    :data:`LEASE` questions) it visits the board (one ``Compare_and_swap`` on rank 0) to extend the
    shared lease by :data:`LEASE` questions past its own, or to learn the stop. The shared lease is
    thus the first question that no rank may have reached; rank 0 decides by freezing it there (slot
    0 then holds ``-(stop + 1)``). Every rank that reaches that question stops there, and the first
    one publishes how many collectives it had run and its site (slot 1). A rank still behind it
    stops earlier, at its first question with that many collectives behind it, asked at the same
    site: between there and the frozen question it would have run no collective, and from the same
    site Lightning runs the same stop (a stop after a batch validates, one after an epoch does not),
    so it stops with the same history as the others (no rank meets another's collective with one of
    its own), without running the batches the fastest rank ran: a straggler stops soon after the
    decision, not where the fastest rank was. The board is one-sided throughout: nothing can hang.
    """

    #: questions a rank answers between two visits to the board
    LEASE = 8
    #: a rank's request: its own decision in a reduction, or its ``broadcast`` of a stop (it decides alone)
    VOTE, STOP = 1, 2

    def __init__(self, comm: Any, resources: RunResources | None = None) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.counters = Counters(comm, 2 + self.size, root=0, resources=resources)
        self._next_visit = 0
        self._requested = 0
        #: the (frozen) question every rank stops at, at the latest, once known here
        self.stop_at: int | None = None
        #: the collectives every rank has run, and the site it asks at, when it stops, once published
        self.stop_point: tuple[int, int] | None = None
        #: whether this rank has stopped: every later question is answered True
        self.stopped = False

    def broadcast_flag(self, value: bool, src: int, index: int, count: int = 0, site: int = 0) -> bool:
        """Question ``index``, at ``site`` after ``count`` collectives: rank ``src``'s ``value`` (a
        stop when True). True from this rank's stop on."""
        if value and self.rank == src:
            self._request(self.STOP)
        return self._answer(index, (count, site), all_votes=False)

    def reduce_flag(self, value: bool, all: bool, index: int, count: int = 0, site: int = 0) -> bool:
        """Question ``index``, at ``site`` after ``count`` collectives: this rank's decision
        ``value``; ``all``: stop once every rank decided, else once any did. True from this rank's
        stop on."""
        if value:
            self._request(self.VOTE)
        return self._answer(index, (count, site), all_votes=all)

    def _request(self, kind: int) -> None:
        if kind > self._requested:
            self.counters.raise_to(2 + self.rank, kind)
            self._requested = kind

    def _answer(self, index: int, point: tuple[int, int], all_votes: bool) -> bool:
        if self.stopped:
            return True
        if self.stop_at is None and (self.rank == 0 or index >= self._next_visit):
            self._visit(index, all_votes)
        if self.stop_at is None:
            return False
        if index >= self.stop_at:  # the frozen question: publish the collectives behind it, and where
            if self.stop_point is None:
                count, site = point
                self.counters.raise_to(1, ((count + 1) << 32) | (site & 0xFFFFFFFF))
                self.stop_point = point
            self.stopped = True
        else:  # behind it: stop at the same point (as many collectives behind, the same site)
            if self.stop_point is None:
                published = int(self.counters.read()[1])
                if published:
                    self.stop_point = ((published >> 32) - 1, published & 0xFFFFFFFF)
            self.stopped = self.stop_point == (point[0], point[1] & 0xFFFFFFFF)
        return self.stopped

    def _visit(self, index: int, all_votes: bool) -> None:
        """Learn the stop, or hold a lease past ``index``; on rank 0, decide (freeze the lease)."""
        while self.stop_at is None:
            board = self.counters.read()
            lease, requests = int(board[0]), board[2:]
            if lease < 0:
                self.stop_at = -lease - 1
                return
            if lease <= index:  # nobody holds this question yet: lease it, and LEASE more
                self.counters.compare_and_swap(0, lease, index + 1 + self.LEASE)
                continue
            self._next_visit = min(lease, index + self.LEASE)
            decided = (requests == self.STOP).any() or (requests.all() if all_votes else requests.any())
            if self.rank != 0 or not decided:
                return
            # the first question no rank may have reached: every rank stops there, at the latest
            if self.counters.compare_and_swap(0, lease, -(lease + 1)) == lease:
                self.stop_at = lease

    def free(self) -> None:
        self.counters.free()
