"""The disk tier of :class:`lightning_mpi.LMSOffload`: saved tensors go to a spill file.

Each training step appends its offloaded tensors to one spill file in ``directory`` with
``os.pwrite`` and reads them back with ``os.preadv``, on one background I/O thread (the calls
release the GIL, so the copies overlap compute). Page-aligned offsets, one file per step per
process: ranks sharing a directory never collide.

The file is unlinked right after it is opened. Its space lives exactly as long as the open
descriptor, which :meth:`DiskTier.end_step` and :meth:`DiskTier.abort` close; even a rank that
``mpiexec`` kills with SIGKILL leaves nothing behind in ``directory``.

CUDA tensors pass through pinned staging buffers from a :class:`HostBufferPool` (device -> host on
a side stream, then the file); CPU tensors are written straight from their memory, which is
released as soon as the write is done. That release is what lowers peak RSS on a CPU-only
machine, provided the allocator gives the memory back: see
:func:`lightning_mpi.offload.allocator.return_freed_memory_to_os`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightning_mpi.offload.pool import HostBufferPool
from lightning_mpi.offload.streams import CopyTimes, SideStreams
from lightning_mpi.offload.tensors import Layout, as_bytes, from_bytes
from lightning_mpi.offload.tiers import Ticket, TierStats

_ALIGN = 4096


class DiskTier:
    """Tensors -> one unlinked spill file per step in ``directory``."""

    def __init__(
        self, directory: str, max_inflight: int, pool: HostBufferPool | None = None, name: str = "lms"
    ) -> None:
        self.directory = directory
        self.max_inflight = max_inflight
        self.pool = pool  # pinned staging buffers; only CUDA tensors need them
        self.name = f"{name}-pid{os.getpid()}"
        # One worker keeps the I/O in submission order: a read always follows its write.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lms-disk-io")
        self._streams = SideStreams()
        self._times = CopyTimes()
        self._lock = threading.Lock()  # guards _stats against the I/O thread
        self._stats = TierStats()
        self._writes: deque[Future] = deque()
        self._fd = -1
        self._end = 0
        self._step = 0

    # --- the four verbs -------------------------------------------------------------------
    def swap_out(self, tensor: torch.Tensor, layout: Layout, version: int) -> Ticket:
        if self._fd < 0:
            self._open()
        ticket = Ticket(layout, version, offset=self._end)
        self._end += -(-layout.nbytes // _ALIGN) * _ALIGN
        self._stats.file_bytes = max(self._stats.file_bytes, self._end)
        if tensor.is_cuda:
            staging = self._staging_pool().acquire(layout.nbytes, stream=self._streams.side(tensor.device))
            start, end = self._streams.d2h(as_bytes(tensor), staging[: layout.nbytes])
            self._times.add(start, end)
            job = _Write(self, ticket, staging[: layout.nbytes], staging=staging, ready=end)
        else:
            job = _Write(self, ticket, as_bytes(tensor))
        ticket.write = self._io.submit(job)
        self._writes.append(ticket.write)
        self._bound_inflight()
        return ticket

    def fetch(self, ticket: Ticket) -> None:
        if ticket.read is None and not ticket.done:
            # A CPU tensor's buffer is allocated here, on the training thread, not on the I/O
            # thread: glibc would serve the I/O thread from its own arena, whose freed memory the
            # training thread cannot reuse, and peak RSS would carry both arenas.
            out = None if ticket.layout.device.type == "cuda" else torch.empty(ticket.layout.nbytes, dtype=torch.uint8)
            ticket.read = self._io.submit(_Read(self, ticket, self._fd, out))

    def take(self, ticket: Ticket) -> torch.Tensor:
        if ticket.done:
            raise RuntimeError("LMSOffload: this saved tensor was already taken or discarded")
        self.fetch(ticket)
        future = ticket.read
        assert future is not None, "fetch() queued the read of a ticket not taken yet"
        if not future.done():
            t0 = time.perf_counter()
            future.result()
            self._add(exposed=time.perf_counter() - t0)
        result = future.result()
        ticket.read, ticket.done = None, True
        if isinstance(result, torch.Tensor):
            return result
        dev, end = result
        if not self._streams.hand_over(dev, end):
            self._times.flag_exposed(end)
        return from_bytes(dev, ticket.layout)

    def used_marker(self, ticket: Ticket):
        """See :meth:`lightning_mpi.offload.tiers.CudaHostTier.used_marker`; ``None`` for a CPU
        tensor (the host is the device: used once backward has moved on)."""
        if ticket.layout.device.type != "cuda":
            return None
        return self._streams.consumed(ticket.layout.device)

    def discard(self, ticket: Ticket) -> None:
        ticket.done = True  # a read not started yet sees this and does nothing
        future, ticket.read = ticket.read, None
        if future is not None:
            future.cancel()  # drops the prefetched tensor, or the job if it has not started

    # --- step boundaries ------------------------------------------------------------------
    def end_step(self) -> TierStats:
        """Wait for every queued copy, close (and so free) the spill file, return the stats."""
        self._io.submit(_noop).result()  # FIFO: everything queued before has finished
        try:
            for future in self._writes:  # surface a failed write (e.g. disk full)
                future.result()
        finally:
            self._writes.clear()
            self._close_file()
        self._times.collect(self._stats)
        with self._lock:
            stats, self._stats = self._stats, TierStats()
        return stats

    def abort(self) -> TierStats:
        """Like :meth:`end_step`, for a step that raised: never raises itself."""
        for future in self._writes:
            future.cancel()
        try:
            self._io.submit(_noop).result()
        except RuntimeError:  # executor already shut down
            pass
        self._writes.clear()
        self._close_file()
        with self._lock:
            stats, self._stats = self._stats, TierStats()
        return stats

    def close(self) -> None:
        self.abort()
        self._io.shutdown(wait=True)
        if self.pool is not None:
            self.pool.clear()

    # --- internals ------------------------------------------------------------------------
    def _open(self) -> None:
        path = os.path.join(self.directory, f"{self.name}-step{self._step}.spill")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        os.unlink(path)  # the space now lives exactly as long as the descriptor
        self._stats.files += 1

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._end = 0
        self._step += 1

    def _staging_pool(self) -> HostBufferPool:
        if self.pool is None:
            self.pool = HostBufferPool(pin_memory=True)
        return self.pool

    def _bound_inflight(self) -> None:
        while self._writes and self._writes[0].done():
            self._writes.popleft().result()  # raises a write error here, in the training thread
        if len(self._writes) > self.max_inflight:
            t0 = time.perf_counter()
            while len(self._writes) > self.max_inflight:
                self._writes.popleft().result()
            self._add(exposed=time.perf_counter() - t0)

    def _add(self, copy: float = 0.0, exposed: float = 0.0) -> None:
        with self._lock:
            self._stats.copy_s += copy
            self._stats.exposed_s += exposed


class _Write:
    """A queued write. Holds the source bytes only until they are on the file, then lets go of
    them: for a CPU tensor that is the moment its memory can be freed."""

    def __init__(
        self,
        tier: DiskTier,
        ticket: Ticket,
        src: torch.Tensor,
        staging: torch.Tensor | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        self.tier, self.ticket = tier, ticket
        self.src: torch.Tensor | None = src
        self.fd = tier._fd
        self.staging, self.ready = staging, ready

    def __call__(self) -> None:
        src = self.src
        assert src is not None, "a write runs once"
        self.src = None
        if self.ready is not None:
            self.ready.synchronize()  # the device -> staging copy has landed
        t0 = time.perf_counter()
        _pwrite_all(self.fd, src.numpy(), self.ticket.offset)
        self.tier._add(copy=time.perf_counter() - t0)
        if self.staging is None and src._version != self.ticket.version:
            # Views share the version counter: the tensor was modified while being written.
            self.ticket.error = "modified in place while it was being written to disk"
        del src
        if self.staging is not None:
            self.tier._staging_pool().release(self.staging)


class _Read:
    """A queued read: into a fresh CPU tensor, or via pinned staging onto the device."""

    def __init__(self, tier: DiskTier, ticket: Ticket, fd: int, out: torch.Tensor | None) -> None:
        self.tier, self.ticket, self.fd, self.out = tier, ticket, fd, out

    def __call__(self):
        ticket, layout = self.ticket, self.ticket.layout
        failed = ticket.write.exception() if ticket.write is not None else None
        if failed is not None:
            raise failed
        if ticket.done:  # discarded while queued
            self.out = None
            return None
        t0 = time.perf_counter()
        if self.out is not None:
            out, self.out = self.out, None
            _pread_all(self.fd, out.numpy(), ticket.offset)
            self.tier._add(copy=time.perf_counter() - t0)
            return from_bytes(out, layout)
        pool = self.tier._staging_pool()
        staging = pool.acquire(layout.nbytes)  # no stream: the host writes it
        _pread_all(self.fd, staging[: layout.nbytes].numpy(), ticket.offset)
        self.tier._add(copy=time.perf_counter() - t0)
        # Allocated on this thread's current stream of the device: the default stream, which is
        # the compute stream unless the model runs under a stream of its own.
        dev, start, end = self.tier._streams.h2d(staging[: layout.nbytes], layout.device)
        self.tier._times.add(start, end)
        pool.release(staging, after=end, stream=self.tier._streams.side(layout.device))
        return dev, end


def _noop() -> None:
    return None


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):  # pwrite may write less than asked (e.g. > 2 GiB)
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"LMSOffload: spill file ended early at offset {offset + done}")
        done += n
