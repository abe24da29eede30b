"""Reusable host buffers for :class:`lightning_mpi.LMSOffload`.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` allocates a fresh pinned buffer for every
saved tensor of every step. Pinned allocation (``cudaHostAlloc``) is slow and serialising, so the
offloader keeps its buffers here instead: a buffer that comes back is reused by the next tensor of
a similar size. A training step saves the same tensors every time, so after the first step the
pool stops growing (``reserved_bytes`` stays flat); tests check exactly that.

Buffers are 1-D ``uint8`` tensors, rounded up to a size class so that a buffer can serve any
tensor in its class. Pageable buffers: 8 classes per power of two (at most 12.5% waste). Pinned
buffers: powers of two, because that is what they cost: torch's pinned (host caching) allocator
rounds every block up to a power of two, so a finer class would only hide the waste from
``reserved_bytes``; with power-of-two classes ``reserved_bytes`` is the pinned memory the pool
holds, and the waste is up to 2x (a 17 MiB activation holds a 32 MiB pinned block). One pinned
slab carved into size classes would remove that waste; it is not done yet.

:meth:`HostBufferPool.clear` drops the pool's buffers *and* asks torch to hand its cached pinned
blocks back to the driver (``torch._C._host_emptyCache``): dropping a pinned tensor alone returns
it to torch's cache, not to the OS. That call frees every unused cached pinned block of the
process, not only the pool's.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

_MIN_CLASS = 4096


class CopyEvent(Protocol):
    """A ``torch.cuda.Event`` as the pool uses it: recorded after the copy that reads a buffer."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def size_class(nbytes: int, pinned: bool = False) -> int:
    """Round ``nbytes`` up to its size class: 4 KiB minimum, then 8 classes per power of two, or
    (``pinned``) the next power of two, as torch's pinned allocator rounds it."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    # step = 1/8 of the power of two at or below nbytes -> waste < 12.5%
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


@dataclass
class PoolStats:
    """A snapshot of a :class:`HostBufferPool`."""

    reserved_bytes: int  # bytes held by the pool, free or lent out
    num_buffers: int  # buffers held by the pool, free or lent out
    in_use_bytes: int  # bytes lent out right now (including releases waiting on an event)
    allocations: int  # buffers ever allocated (each one a cudaHostAlloc when pinned)


def return_cached_pinned_memory() -> None:
    """Hand torch's cached, unused pinned blocks back to the driver (``cudaFreeHost``), where
    CUDA is initialised and torch has the call; else nothing."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty()


class HostBufferPool:
    """A thread-safe pool of host buffers, page-locked when ``pin_memory`` is true.

    ``acquire(n)`` lends a buffer of at least ``n`` bytes; ``release(buf, after=event,
    stream=s)`` gives it back, optionally only once a CUDA event (recorded on stream ``s``) has
    completed: the copy that reads the buffer is still queued. Buffers are never freed except by
    :meth:`clear`.

    ``acquire(n, stream=s)`` may also lend a buffer whose release still waits on an event of that
    same stream ``s``: the caller's copy into it is queued on ``s`` after the pending one, so
    stream order already keeps them apart. The host never waits, and the pool does not grow
    because the host runs a step ahead of the GPU.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = bool(pin_memory)
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        # (event, stream, buffer): released "after" an event that had not completed yet
        self._deferred: deque[tuple[CopyEvent, object, torch.Tensor]] = deque()
        self._reserved = 0
        self._count = 0
        self._in_use = 0
        self._allocations = 0

    def acquire(self, nbytes: int, stream: object | None = None) -> torch.Tensor:
        """Lend a buffer of at least ``nbytes`` bytes (its length is the size class). Pass the
        CUDA ``stream`` that will write into it to allow reuse ordered by that stream."""
        cls = size_class(nbytes, self.pin_memory)
        with self._lock:
            self._reclaim_locked()
            free = self._free.get(cls)
            buf = free.pop() if free else None
            if buf is None and stream is not None:
                buf = self._take_deferred_locked(cls, stream)
            if buf is None:
                buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin_memory)
                self._reserved += cls
                self._count += 1
                self._allocations += 1
            self._in_use += cls
            return buf

    def release(self, buf: torch.Tensor, after: CopyEvent | None = None, stream: object | None = None) -> None:
        """Give ``buf`` back. With ``after`` (a ``torch.cuda.Event`` recorded on ``stream``) it is
        reused only once the event has completed, or by a copy queued on the same stream, so a
        copy still in flight never sees its buffer handed to another tensor."""
        with self._lock:
            if after is not None and not after.query():
                self._deferred.append((after, stream, buf))
                return
            self._return_locked(buf)

    def stats(self) -> PoolStats:
        with self._lock:
            self._reclaim_locked()
            return PoolStats(self._reserved, self._count, self._in_use, self._allocations)

    def clear(self) -> None:
        """Free every buffer that is not lent out, and (pinned) return torch's cached pinned
        blocks to the driver. Buffers whose release waits on an event are waited for first:
        freeing host memory under a running copy would corrupt it."""
        with self._lock:
            for event, _, buf in self._deferred:
                event.synchronize()
                self._return_locked(buf)
            self._deferred.clear()
            for cls, bufs in self._free.items():
                self._reserved -= cls * len(bufs)
                self._count -= len(bufs)
            self._free.clear()
        if self.pin_memory:
            return_cached_pinned_memory()

    def _reclaim_locked(self) -> None:
        # Releases can wait on events of different streams (one side stream per device), so
        # check them all; the list is as short as the number of copies in flight.
        pending: deque[tuple[CopyEvent, object, torch.Tensor]] = deque()
        for entry in self._deferred:
            if entry[0].query():
                self._return_locked(entry[2])
            else:
                pending.append(entry)
        self._deferred = pending

    def _take_deferred_locked(self, cls: int, stream: object) -> torch.Tensor | None:
        for i, (_, deferred_stream, buf) in enumerate(self._deferred):
            if deferred_stream is not None and deferred_stream == stream and buf.numel() == cls:
                del self._deferred[i]
                self._in_use -= cls  # counted again by the caller
                return buf
        return None

    def _return_locked(self, buf: torch.Tensor) -> None:
        cls = buf.numel()
        self._in_use -= cls
        self._free.setdefault(cls, []).append(buf)
