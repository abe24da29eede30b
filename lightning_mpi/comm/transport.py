"""Raw MPI data movement on torch tensors, with device staging decided once.

Torch tensors go to mpi4py directly (mpi4py reads them through DLPack / the CUDA array
interface), so there is no Python-level copy. A CUDA tensor is passed as a device buffer when the
MPI library is CUDA-aware; otherwise it is staged through a pinned host buffer that is allocated
once per shape and reused. 16-bit tensors travel as ``int16`` words: MPI only moves them.
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.cuda import mpi_is_cuda_aware

_AS_WORDS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _mpi_view(tensor: Tensor) -> Tensor:
    """A view MPI can move: 16-bit floats as int16 words, everything else as is."""
    words = _AS_WORDS.get(tensor.dtype)
    return tensor.view(words) if words is not None else tensor


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: some rank never joined it."""


def wait_request(request: Any, timeout: float | None, what: str, rank: int, size: int) -> None:
    """Wait for ``request``; raise :class:`CollectiveTimeout` after ``timeout`` seconds.

    Polls with ``Test`` (which also drives MPICH's progress) and, after a short spin, sleeps
    0.2 ms between polls so that oversubscribed ranks leave the core to the ranks they wait for.
    The spin is short (100 polls, well under a millisecond): a longer one cost ~20 ms of CPU per
    step in pipelined ASA, where every segment's wait spun before it slept.
    """
    if timeout is None:
        request.Wait()
        return
    deadline = time.monotonic() + timeout
    spins = 0
    while not request.Test():
        spins += 1
        if spins > 100:
            time.sleep(0.0002)
        if time.monotonic() > deadline:
            raise CollectiveTimeout(
                f"lightning_mpi: {what} on rank {rank} waited more than {timeout:g} s for the other "
                f"{size - 1} rank(s). A rank may have died or hung, or ranks ran different numbers of "
                "steps (uneven data shards). If a step can legitimately take that long, raise the "
                "limit: MPIStrategy(collective_timeout=...)."
            )


class Transport:
    """Blocking and non-blocking collectives on contiguous torch tensors over one communicator.

    Args:
        comm: an mpi4py intracommunicator. Every rank of it must call the same collectives in the
            same order (the usual MPI contract).
        timeout: seconds a blocking collective may wait for the other ranks before raising
            :class:`CollectiveTimeout`; ``None`` waits forever.
    """

    def __init__(self, comm: Any, timeout: float | None = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.timeout = timeout
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self._staging: dict[tuple, Tensor] = {}

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

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Broadcast a picklable object (two ``Ibcast``s: length, then bytes), with the timeout."""
        import numpy as np

        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == root else None
        length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=root), "broadcast")
        buffer = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
        self._wait(self.comm.Ibcast(buffer, root=root), "broadcast")
        return obj if self.rank == root else pickle.loads(buffer.tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking, no timeout)."""
        return self.comm.allgather(obj)

    def _wait(self, request: Any, what: str) -> None:
        wait_request(request, self.timeout, what, self.rank, self.size)

    def dup(self) -> "Transport":
        """A transport over a duplicate communicator (collective over this one).

        Non-blocking collectives on one communicator must be started in the same order on every
        rank. Exchanges that progress independently (buckets launched from gradient hooks,
        pipelined segments) therefore each get their own communicator."""
        return Transport(self.comm.Dup(), self.timeout)

    def free(self) -> None:
        """Free this transport's communicator (only for ones made by :meth:`dup` or
        :meth:`node_split`; collective over it). Safe to call twice; the transport is unusable after."""
        comm = self.comm
        if comm is not None and comm != self.MPI.COMM_NULL and comm not in (self.MPI.COMM_WORLD, self.MPI.COMM_SELF):
            comm.Free()

    def node_split(self) -> tuple["Transport", "Transport | None"]:
        """Transports for this node's ranks and for the node leaders (``None`` unless local rank 0).

        Nodes are MPI's shared-memory domains (``COMM_TYPE_SHARED``). For tests on one machine,
        ``LIGHTNING_MPI_RANKS_PER_NODE=k`` groups consecutive ranks into pretend nodes of ``k``.
        """
        import os

        per_node = os.environ.get("LIGHTNING_MPI_RANKS_PER_NODE")
        if per_node:
            local = self.comm.Split(color=self.rank // int(per_node), key=self.rank)
        else:
            local = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        is_leader = local.Get_rank() == 0
        leaders = self.comm.Split(color=0 if is_leader else self.MPI.UNDEFINED, key=self.rank)
        return Transport(local, self.timeout), (Transport(leaders, self.timeout) if is_leader else None)

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
