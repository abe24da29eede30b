"""Where offloaded tensors live between forward and backward: pinned host memory or files.

A tier moves bytes and nothing else; which tensors to move and when is decided by
:class:`lightning_mpi.offload.session.OffloadSession`. Every tier has the same four verbs:

* ``swap_out(tensor)`` starts copying a tensor out and returns a :class:`Ticket`. With more than
  ``max_inflight`` copies in flight it applies back-pressure: the CUDA tier makes the compute
  stream wait for the oldest copy (the host never blocks); the disk tier's host waits for the
  oldest write (exposed time).
* ``fetch(ticket)`` starts bringing it back (a prefetch); idempotent.
* ``take(ticket)`` returns the tensor, waiting for the copy if it is not back yet (exposed time).
* ``discard(ticket)`` forgets a tensor nobody will unpack.
* ``used_marker(ticket)``, called once backward has queued the work that uses a taken tensor:
  an object whose ``query()`` says the device has run that work, or ``None`` when it has (CPU).
  The session counts a restored tensor in its prefetch window until then, so that prefetching is
  paced by the device's progress, not by the host's (which runs ahead).

``end_step()`` waits for every copy, frees the step's files and returns the step's
:class:`TierStats`; ``abort()`` does the same without waiting for work that has not started.

The CUDA stream rules both tiers follow are in :mod:`lightning_mpi.offload.streams`.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_mpi.offload.pool import HostBufferPool
from lightning_mpi.offload.streams import CopyTimes, SideStreams
from lightning_mpi.offload.tensors import Layout, as_bytes, from_bytes


@dataclass
class TierStats:
    """What a tier did during one step (times in seconds)."""

    copy_s: float = 0.0  # time spent copying, both directions
    exposed_s: float = 0.0  # part of it the training thread waited for
    file_bytes: int = 0  # size the step's spill file reached (disk tier)
    files: int = 0  # spill files opened this step (disk tier)


@dataclass(eq=False)
class Ticket:
    """One swapped-out tensor, as its tier keeps it."""

    layout: Layout
    version: int  # the tensor's version counter when it was saved
    error: str | None = None  # set when the copy found the tensor modified in place
    done: bool = False  # taken or discarded: its storage may be reused
    prefetched: bool = False  # in the session's prefetch window: fetched, not taken, not passed
    order: int = -1  # position in its forward pass (set by the session)
    buf: torch.Tensor | None = None  # pinned copy (CUDA host tier)
    offset: int = -1  # position in the spill file (disk tier)
    write: Future | None = None
    read: Future | None = None
    restored: Any = None  # CUDA host tier: (device tensor, end event) once fetched
    extra: dict = field(default_factory=dict)


class CudaHostTier:
    """CUDA tensors -> pinned host buffers from a reusable :class:`HostBufferPool`."""

    def __init__(self, pool: HostBufferPool, max_inflight: int, cuda=None) -> None:
        self.pool = pool
        self.max_inflight = max_inflight
        self._streams = SideStreams(cuda)
        self._times = CopyTimes()
        self._inflight: deque[torch.cuda.Event] = deque()
        self._stats = TierStats()

    def swap_out(self, tensor: torch.Tensor, layout: Layout, version: int) -> Ticket:
        ticket = Ticket(layout, version)
        side = self._streams.side(tensor.device)
        # A buffer still being read by an earlier copy on this side stream is fine: this copy
        # is queued behind it.
        ticket.buf = self.pool.acquire(layout.nbytes, stream=side)
        start, end = self._streams.d2h(as_bytes(tensor), ticket.buf[: layout.nbytes])
        self._times.add(start, end)
        ticket.extra["written"] = end
        ticket.extra["stream"] = side
        self._inflight.append(end)
        self._bound_inflight(tensor.device)
        return ticket

    def fetch(self, ticket: Ticket) -> None:
        if ticket.done or ticket.restored is not None:
            return
        buf = ticket.buf
        assert buf is not None, "a swapped-out ticket holds its pinned copy until fetched"
        # Same side stream as the swap-out: stream order puts this copy after it.
        dev, start, end = self._streams.h2d(buf[: ticket.layout.nbytes], ticket.layout.device)
        self._times.add(start, end)
        self.pool.release(buf, after=end, stream=ticket.extra["stream"])  # reusable once read
        ticket.buf = None
        ticket.restored = (dev, end)

    def take(self, ticket: Ticket) -> torch.Tensor:
        if ticket.done:
            raise RuntimeError("LMSOffload: this saved tensor was already taken or discarded")
        self.fetch(ticket)
        dev, end = ticket.restored
        ticket.restored, ticket.done = None, True
        if not self._streams.hand_over(dev, end):
            # The compute stream stalls on this copy; count its duration as exposed.
            self._times.flag_exposed(end)
        return from_bytes(dev, ticket.layout)

    def used_marker(self, ticket: Ticket):
        """An event on the compute stream, recorded now: done once the device has run every
        kernel queued so far, the consumer of ``ticket``'s restored tensor included."""
        return self._streams.consumed(ticket.layout.device)

    def discard(self, ticket: Ticket) -> None:
        ticket.done = True
        if ticket.buf is not None:
            self.pool.release(ticket.buf, after=ticket.extra.get("written"), stream=ticket.extra.get("stream"))
            ticket.buf = None
        ticket.restored = None  # a prefetched device tensor; record_stream not needed, unused

    def end_step(self) -> TierStats:
        self._inflight.clear()  # later swap-outs wait on their own events
        self._times.collect(self._stats)
        stats, self._stats = self._stats, TierStats()
        return stats

    abort = end_step

    def close(self) -> None:
        self.pool.clear()

    def _bound_inflight(self, device: torch.device) -> None:
        """Back-pressure without blocking the host: past ``max_inflight`` copies, the compute
        stream waits for the oldest one. Its source stays alive meanwhile (``record_stream``:
        the caching allocator reuses the block only once the copy has read it); the wait keeps
        the device from running further ahead of its copies. Its cost shows up in step time,
        not in ``exposed_s`` (measuring it would need a host wait)."""
        while self._inflight and self._inflight[0].query():
            self._inflight.popleft()
        while len(self._inflight) > self.max_inflight:
            self._streams.gate(device, self._inflight.popleft())
