"""Raw MPI data movement on torch tensors, with device staging decided once.

Torch tensors go to mpi4py directly (mpi4py reads them through DLPack / the CUDA array
interface), so there is no Python-level copy. A CUDA tensor is passed as a device buffer when the
MPI library is CUDA-aware; otherwise it is staged through a pinned host buffer that is allocated
once per shape and reused. 16-bit tensors travel as ``int16`` words: MPI only moves them.
"""

from __future__ import annotations

import os
import pickle
import time
import zlib
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_mpi.comm.cuda import mpi_is_cuda_aware
from lightning_mpi.comm.errors import AbandonedRunError, process_failure
from lightning_mpi.comm.resources import RunResources, keep_pending
from lightning_mpi.comm.ring import allreduce_steps, ring_tags
from lightning_mpi.comm.ulfm import heal_support

_AS_WORDS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _mpi_view(tensor: Tensor) -> Tensor:
    """A view MPI can move: 16-bit floats as int16 words, everything else as is."""
    words = _AS_WORDS.get(tensor.dtype)
    return tensor.view(words) if words is not None else tensor


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: some rank never joined it."""


class CollectiveMismatch(RuntimeError):
    """The ranks called different collectives (:meth:`Transport.same_collective`).

    Attributes:
        calls: what each rank called, in rank order.
    """

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        seen = "; ".join(f"rank {rank}: {call}" for rank, call in enumerate(calls))
        super().__init__(
            f"lightning_mpi: the ranks called different collectives ({seen}), so no data was exchanged. Every "
            "rank must call Lightning's collectives (self.log(..., sync_dist=True), a metric's sync, "
            "trainer.strategy.reduce/broadcast/barrier) in the same order with data of the same shape: look for a "
            "branch on the rank (if self.global_rank == 0: ...) or a loop that runs a different number of times "
            "on different ranks"
        )


#: seconds a wait that must not leave its operation half-agreed keeps going after another rank's
#: failure became known (``wait_request(settle=True)``)
SETTLE_SECONDS = 5.0


def wait_request(
    request: Any,
    timeout: float | None,
    what: str,
    rank: int,
    size: int,
    watch: Callable[[], None] | None = None,
    settle: bool = False,
    comm: Any = None,
) -> None:
    """Wait for ``request``; raise :class:`CollectiveTimeout` after ``timeout`` seconds (``None``:
    never), or whatever ``watch()`` raises (another rank failed: see
    :class:`~lightning_mpi.comm.errors.ErrorChannel`).

    Polls with ``Test`` (which also drives MPICH's progress) and, after a short spin, sleeps
    0.2 ms between polls so that oversubscribed ranks leave the core to the ranks they wait for.
    The spin is short (100 polls, well under a millisecond): a longer one cost ~20 ms of CPU per
    step in pipelined ASA, where every segment's wait spun before it slept. ``watch`` runs at
    every sleeping poll (one ``Iprobe``).

    ``settle=True`` is for an agreement that a blocking collective follows (a window's creation):
    once one rank's request completed, every rank has joined and will enter that collective, so a
    rank that learns of a failure keeps waiting for up to :data:`SETTLE_SECONDS` and goes ahead if
    the request completes; it raises only if the request cannot complete (a rank never joined).

    Under ULFM, an MPI error that reports a dead rank (from ``Test`` or ``watch``) is raised as
    :class:`~lightning_mpi.comm.errors.ProcessFailed` naming the dead ranks of ``comm`` (when given).
    """
    try:
        _wait_request(request, timeout, what, rank, size, watch, settle)
    except Exception as error:
        failed = process_failure(error, comm, what)
        if failed is None or failed is error:
            raise
        keep_pending(request)  # it can never complete now; MPI may still hold its buffers
        raise failed from error


def _wait_request(
    request: Any, timeout: float | None, what: str, rank: int, size: int, watch: Callable[[], None] | None, settle: bool
) -> None:
    deadline = time.monotonic() + timeout if timeout is not None else None
    spins = 0
    while not request.Test():
        spins += 1
        if spins <= 100:
            continue
        time.sleep(0.0002)
        if watch is not None:
            try:
                watch()
            except BaseException:
                if not settle or _never_completes(request, SETTLE_SECONDS):
                    keep_pending(request)  # MPI may still complete it, into its buffers
                    raise
                return
        if deadline is not None and time.monotonic() > deadline:
            keep_pending(request)
            raise CollectiveTimeout(
                f"lightning_mpi: {what} on rank {rank} waited more than {timeout:g} s for the other "
                f"{size - 1} rank(s). A rank may have died or hung, or ranks ran different numbers of "
                "steps (uneven data shards). If a step can legitimately take that long, raise the "
                "limit: MPIStrategy(collective_timeout=...)."
            )


def _never_completes(request: Any, seconds: float) -> bool:
    """True if ``request`` does not complete within ``seconds`` of polling."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if request.Test():
            return False
        time.sleep(0.0005)
    return True


class Transport:
    """Blocking and non-blocking collectives on contiguous torch tensors over one communicator.

    Args:
        comm: an mpi4py intracommunicator. Every rank of it must call the same collectives in the
            same order (the usual MPI contract).
        timeout: seconds a blocking collective may wait for the other ranks before raising
            :class:`CollectiveTimeout`; ``None`` waits forever.
        errors: an :class:`~lightning_mpi.comm.errors.ErrorChannel` that every wait watches, so that
            a wait raises :class:`~lightning_mpi.comm.errors.RankFailedError` as soon as another rank
            failed; ``None``: nothing to watch.
        resources: where the communicators and windows made for this run are tracked (see
            :mod:`lightning_mpi.comm.resources`); transports made by :meth:`dup` share it.
        ring: sums (:meth:`iallreduce_`) of host buffers go over point-to-point messages
            (:mod:`lightning_mpi.comm.ring`) instead of a non-blocking collective; ``None``: when the
            job runs with Open MPI's fault tolerance on (``--with-ft ulfm``), whose non-blocking
            collectives abort a live process after a peer's failure (see there). Transports made
            from this one keep it.
    """

    def __init__(
        self,
        comm: Any,
        timeout: float | None = None,
        errors: Any = None,
        resources: RunResources | None = None,
        ring: bool | None = None,
    ) -> None:
        from mpi4py import MPI  # deferred: importing it initialises MPI (see lightning_mpi.comm)

        self.MPI = MPI
        self.timeout = timeout
        self.comm = comm
        self.errors = errors
        self.resources = resources if resources is not None else RunResources()
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self._staging: dict[tuple, Tensor] = {}
        self.ring = heal_support().ok if ring is None else ring
        self._tags = ring_tags()

    def _derived(self, comm: Any) -> Transport:
        """A transport over ``comm`` (made from this one's) with this one's settings."""
        return Transport(self.resources.comm(comm), self.timeout, self.errors, self.resources, self.ring)

    @property
    def abandoned(self) -> bool:
        """True once the run this transport belongs to failed and was abandoned."""
        return self.resources.abandoned

    def watch(self) -> None:
        """Raise if the run failed (another rank posted an error, or this run was abandoned)."""
        if self.errors is not None:
            self.errors.check()
        if self.resources.abandoned:
            raise AbandonedRunError(
                "lightning_mpi: this communicator belongs to a run that failed and was abandoned; start a new "
                "run (a new fit, or fabric.setup again), which works on fresh communicators."
            )

    def report_thread_failure(self, error: BaseException) -> None:
        """A background thread working for this transport failed: the other ranks are told at once,
        and this rank's next wait raises ``error`` (nothing to do without an error channel: the
        thread's owner raises it)."""
        if self.errors is not None:
            self.errors.post_from_thread(error)

    # -- staging -------------------------------------------------------------------------------
    def _needs_staging(self, tensor: Tensor) -> bool:
        return tensor.is_cuda and not mpi_is_cuda_aware()

    def host_buffer(self, like: Tensor, slot: str) -> Tensor:
        """Pinned host buffer shaped like ``like``, reused per (slot, device buffer, shape, dtype).

        Device buffers are long-lived bucket buffers, so keying by their address keeps concurrent
        non-blocking exchanges apart while the cache stays bounded."""
        key = (slot, like.data_ptr(), tuple(like.shape), like.dtype)
        buf = self._staging.get(key)
        if buf is None:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=torch.cuda.is_available())
            self._staging[key] = buf
        return buf

    def _host(self, tensor: Tensor, slot: str, copy_in: bool) -> Tensor:
        if not self._needs_staging(tensor):
            return tensor
        host = self.host_buffer(tensor, slot)
        if copy_in:
            host.copy_(tensor)
        return host

    @staticmethod
    def _back(host: Tensor, tensor: Tensor) -> None:
        if host is not tensor:
            tensor.copy_(host)

    def _sync_device(self, *tensors: Tensor) -> None:
        # MPI reads device memory outside torch's stream order: finish pending kernels first.
        if any(t.is_cuda for t in tensors) and mpi_is_cuda_aware():
            torch.cuda.current_stream().synchronize()

    # -- blocking collectives: the non-blocking ones below, waited for with the timeout ---------
    def allreduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In-place allreduce with ``op`` in {"sum", "max", "min", "prod"}."""
        return self._complete(self.iallreduce_(tensor, op), "allreduce")

    def alltoall(self, send: Tensor, recv: Tensor) -> Tensor:
        """Row ``j`` of ``send`` (``[size, k]``) goes to rank ``j``; row ``i`` of ``recv`` came from rank ``i``."""
        return self._complete(self.ialltoall(send, recv), "alltoall")

    def allgather(self, send: Tensor, recv: Tensor) -> Tensor:
        """Every rank's ``send`` (``[k]`` or ``[1, k]``) lands in row ``rank`` of ``recv`` (``[size, k]``)."""
        return self._complete(self.iallgather(send, recv), "allgather")

    def broadcast_(self, tensor: Tensor, root: int = 0) -> Tensor:
        """In-place broadcast of ``tensor`` from ``root``."""
        return self._complete(self.ibroadcast_(tensor, root), "broadcast")

    def _complete(self, steps: Generator[Any, None, Tensor], what: str) -> Tensor:
        """Run a non-blocking operation to its end, waiting on each of its requests with the timeout."""
        try:
            request = next(steps)
            while True:
                self._wait(request, what)
                request = next(steps)
        except StopIteration as done:
            return done.value

    def same_collective(self, call: str) -> None:
        """Check that every rank is at the same collective before its data moves: one ``Allreduce``
        of a 64-bit code of ``call`` (what it is and the shape of its data, the same text on every
        rank). Two ranks that called different collectives would otherwise exchange each other's
        bytes. Raises :class:`CollectiveMismatch` naming each rank's call, on every rank (each sees
        the mismatch in the same reduction)."""
        code = zlib.crc32(call.encode())
        header = torch.tensor([code, -code], dtype=torch.int64)
        self.allreduce_(header, "max")
        if header[0] != -header[1]:
            raise CollectiveMismatch(self.allgather_object(call))

    def barrier(self, agree: bool = False) -> None:
        """Wait until every rank is here. ``agree=True`` before a blocking collective (a window's
        creation): once the barrier completed anywhere, every rank goes on (see :func:`wait_request`)."""
        self._wait(self.comm.Ibarrier(), "barrier", settle=agree)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object (two ``Ibcast``s: length, then bytes), with the timeout."""
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == root else None
        length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=root), "broadcast")
        buffer = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
        self._wait(self.comm.Ibcast(buffer, root=root), "broadcast")
        return obj if self.rank == root else pickle.loads(buffer.tobytes())

    def allgather_object(self, obj: Any, settle: bool = False) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (``Iallgather`` of the lengths, then
        ``Iallgatherv`` of the bytes, with the timeout)."""
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([payload.size], dtype=np.int64), lengths), "allgather", settle=settle)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        request = self.comm.Iallgatherv(payload, [gathered, lengths.tolist(), offsets.tolist(), self.MPI.BYTE])
        self._wait(request, "allgather", settle=settle)
        return [
            pickle.loads(gathered[o : o + n].tobytes()) for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)
        ]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's picklable ``obj`` in rank order on ``root`` (None elsewhere): ``Igather`` of
        the lengths, then ``Igatherv`` of the bytes, with the timeout."""
        import numpy as np

        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Igather(np.array([payload.size], dtype=np.int64), lengths, root=root), "gather")
        if self.rank != root:
            self._wait(self.comm.Igatherv(payload, None, root=root), "gather")
            return None
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        gathered = np.empty(int(lengths.sum()), dtype=np.uint8)
        request = self.comm.Igatherv(payload, [gathered, lengths.tolist(), offsets.tolist(), self.MPI.BYTE], root=root)
        self._wait(request, "gather")
        return [
            pickle.loads(gathered[o : o + n].tobytes()) for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)
        ]

    def agree(self, obj: Any) -> list[Any]:
        """:meth:`allgather_object` that completes on every rank once it completed on one, so that
        a blocking collective may follow (see :func:`wait_request`'s ``settle``)."""
        return self.allgather_object(obj, settle=True)

    def _wait(self, request: Any, what: str, settle: bool = False) -> None:
        if self.resources.abandoned:
            self.watch()
        wait_request(request, self.timeout, what, self.rank, self.size, self.watch, settle=settle, comm=self.comm)

    def dup(self) -> Transport:
        """A transport over a duplicate communicator (collective over this one: a watched ``Idup``).

        Non-blocking collectives on one communicator must be started in the same order on every
        rank. Exchanges that progress independently (buckets launched from gradient hooks,
        pipelined segments) therefore each get their own communicator."""
        comm, request = self.comm.Idup()
        self._wait(request, "communicator duplication", settle=True)
        return self._derived(comm)

    def free(self) -> None:
        """Free this transport's communicator (only for ones made by :meth:`dup` or
        :meth:`node_split`). Local in MPICH; a no-op once the run was abandoned (the communicator
        is reclaimed by the next run). The transport is unusable after."""
        comm = self.comm
        if comm is not None and comm != self.MPI.COMM_NULL and comm not in (self.MPI.COMM_WORLD, self.MPI.COMM_SELF):
            self.resources.free_comm(comm)

    def node_split(self) -> tuple[Transport, Transport | None]:
        """Transports for this node's ranks and for the node leaders (``None`` unless local rank 0).

        Nodes are MPI's shared-memory domains (``COMM_TYPE_SHARED``). For tests on one machine,
        ``LIGHTNING_MPI_RANKS_PER_NODE=k`` groups consecutive ranks into pretend nodes of ``k``.
        Collective: an agreeing barrier first, since the splits block.
        """
        self.barrier(agree=True)
        per_node = os.environ.get("LIGHTNING_MPI_RANKS_PER_NODE")
        if per_node:
            local = self.comm.Split(color=self.rank // int(per_node), key=self.rank)
        else:
            local = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        is_leader = local.Get_rank() == 0
        leaders = self.comm.Split(color=0 if is_leader else self.MPI.UNDEFINED, key=self.rank)
        local_t = self._derived(local)
        if not is_leader:
            return local_t, None
        return local_t, self._derived(leaders)

    def split(self, color: int | None, key: int | None = None) -> Transport | None:
        """A transport over the ranks that pass the same ``color`` (ordered by ``key``, default this
        rank), or ``None`` on a rank that passes ``None`` (``MPI_UNDEFINED``). Collective: every rank
        calls it, after an agreeing barrier, since the split blocks; the communicator is tracked by
        this run's resources (a heal revokes it, the rule binds anew)."""
        self.barrier(agree=True)
        comm = self.comm.Split(
            color=self.MPI.UNDEFINED if color is None else color, key=self.rank if key is None else key
        )
        if color is None:
            return None
        return self._derived(comm)

    # -- non-blocking: generators that yield one MPI request and finish after it completes ----------
    # Staging copies happen before the start and after completion, inside the generator, so a
    # caller just ``yield from``s them (see lightning_mpi.comm.engine).
    def iallreduce_(self, tensor: Tensor, op: str = "sum") -> Generator[Any, None, Tensor]:
        """Non-blocking in-place allreduce with ``op`` in {"sum", "max", "min", "prod"}."""
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN, "prod": self.MPI.PROD}[op]
        if tensor.dtype in _AS_WORDS:
            raise TypeError(f"allreduce_ cannot sum {tensor.dtype} words; upcast to float32 first")
        self._sync_device(tensor)
        host = self._host(tensor, "iallreduce", copy_in=True)
        if self.ring and host.device.type == "cpu" and host.is_contiguous():
            yield from allreduce_steps(self.comm, host.view(-1), op, next(self._tags))
        else:
            yield self.comm.Iallreduce(self.MPI.IN_PLACE, host, op=mpi_op)
        self._back(host, tensor)
        return tensor

    def ialltoall(self, send: Tensor, recv: Tensor) -> Generator[Any, None, Tensor]:
        self._sync_device(send, recv)
        hs = self._host(send, "ialltoall_send", copy_in=True)
        hr = self._host(recv, "ialltoall_recv", copy_in=False)
        yield self.comm.Ialltoall(_mpi_view(hs), _mpi_view(hr))
        self._back(hr, recv)
        return recv

    def iallgather(self, send: Tensor, recv: Tensor) -> Generator[Any, None, Tensor]:
        self._sync_device(send, recv)
        hs = self._host(send, "iallgather_send", copy_in=True)
        hr = self._host(recv, "iallgather_recv", copy_in=False)
        yield self.comm.Iallgather(_mpi_view(hs), _mpi_view(hr))
        self._back(hr, recv)
        return recv

    def ireduce_(self, tensor: Tensor, root: int = 0) -> Generator[Any, None, Tensor]:
        """Non-blocking in-place sum onto ``root`` (other ranks' ``tensor`` is left as it was)."""
        self._sync_device(tensor)
        host = self._host(tensor, "ireduce", copy_in=True)
        if self.rank == root:
            yield self.comm.Ireduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM, root=root)
            self._back(host, tensor)
        else:
            yield self.comm.Ireduce(host, None, op=self.MPI.SUM, root=root)
        return tensor

    def ibroadcast_(self, tensor: Tensor, root: int = 0) -> Generator[Any, None, Tensor]:
        self._sync_device(tensor)
        host = self._host(tensor, "ibcast", copy_in=True)
        yield self.comm.Ibcast(_mpi_view(host), root=root)
        self._back(host, tensor)
        return tensor
