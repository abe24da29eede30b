"""CUDA copies on side streams, and their timing, for the offload tiers.

The rules, written down once here: copies run on a side stream per device; before a copy the side
stream waits for the compute stream (no copy before the tensor is produced, and no write into a
block before the compute stream's last use of it); a source tensor gets ``record_stream(side)``
(no free before its copy is done). A tensor coming back is *allocated on the compute stream* (the
caching allocator keeps blocks per stream: a block allocated under the side stream could never be
reused by the compute stream's own allocations, and reserved memory would grow), written on the
side stream (``record_stream(side)``: not freed under the copy), and the consumer's stream waits
for the copy's event before using it (``record_stream(consumer)`` where the consumer is another
stream than the one it was allocated on).

The host never waits on the device here: back-pressure is the compute stream waiting on an event
(:meth:`SideStreams.gate`), not ``event.synchronize()``.

``cuda`` (default ``torch.cuda``) is a parameter so that the order of these calls can be checked
without a GPU, against a recording stand-in.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class CopyTotals(Protocol):
    """Where :meth:`CopyTimes.collect` adds its seconds (a tier's
    :class:`~lightning_mpi.offload.tiers.TierStats`)."""

    copy_s: float
    exposed_s: float


class SideStreams:
    """One side stream per CUDA device, and the stream-safety rules for copies on it."""

    def __init__(self, cuda=None) -> None:
        self.cuda = torch.cuda if cuda is None else cuda
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = self.cuda.Stream(device=device)
        return self._side[device]

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue ``dst.copy_(src)`` (device -> pinned host) on the side stream."""
        compute = self.cuda.current_stream(src.device)  # before switching streams
        side = self.side(src.device)
        side.wait_stream(compute)  # the kernel that produced src has been queued before this
        start = self.cuda.Event(enable_timing=True)
        end = self.cuda.Event(enable_timing=True)
        with self.cuda.stream(side):
            start.record(side)
            dst.copy_(src, non_blocking=True)
            end.record(side)
        # The caller drops its reference now; the caching allocator must not hand src's block
        # to another tensor until the side stream has read it.
        self._record(src, side)
        return start, end

    def h2d(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event, torch.cuda.Event]:
        """Queue a pinned host -> new device tensor copy on the side stream. The device tensor
        is allocated on the calling thread's current (compute) stream of ``device``."""
        compute = self.cuda.current_stream(device)
        side = self.side(device)
        start = self.cuda.Event(enable_timing=True)
        end = self.cuda.Event(enable_timing=True)
        with self.cuda.device(device):
            dev = torch.empty(src.numel(), dtype=torch.uint8, device=device)  # on `compute`
        # The block may have been freed by compute-stream work still queued: the copy must not
        # write into it before that work has run.
        side.wait_stream(compute)
        with self.cuda.stream(side):
            start.record(side)
            dev.copy_(src, non_blocking=True)
            end.record(side)
        self._record(dev, side)  # freed early (a discarded prefetch): not reused under the copy
        return dev, start, end

    def hand_over(self, dev: torch.Tensor, end: torch.cuda.Event) -> bool:
        """Make ``dev`` safe to use on the calling thread's current stream. Returns whether the
        copy was already complete (its time hidden)."""
        done = end.query()
        consumer = self.cuda.current_stream(dev.device)
        consumer.wait_event(end)  # no use before the copy has landed
        self._record(dev, consumer)  # a no-op when the consumer is the stream it was allocated on
        return done

    @staticmethod
    def _record(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    def gate(self, device: torch.device, event: torch.cuda.Event) -> None:
        """Make the compute stream of ``device`` wait for ``event`` (a copy's end): back-pressure
        on the device, the host does not block."""
        self.cuda.current_stream(device).wait_event(event)

    def consumed(self, device: torch.device) -> torch.cuda.Event:
        """An event recorded now on the compute stream of ``device``: once it has completed, the
        device has run every kernel queued so far (e.g. the consumer of a restored tensor)."""
        event = self.cuda.Event()
        event.record(self.cuda.current_stream(device))
        return event


class CopyTimes:
    """CUDA copy durations, read from timing events once they have completed (never forcing a
    synchronisation: a step's late copies are counted in the next step). Thread-safe: the disk
    tier adds copies from its I/O thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []

    def add(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        with self._lock:
            self._pending.append((start, end, False))

    def flag_exposed(self, end: torch.cuda.Event) -> None:
        with self._lock:
            for i, (s, e, _) in enumerate(self._pending):
                if e is end:
                    self._pending[i] = (s, e, True)
                    return

    def collect(self, stats: CopyTotals) -> None:
        """Add the durations of the copies that have completed to ``stats`` (the exposed ones to
        ``exposed_s`` too); the others stay pending."""
        with self._lock:
            keep = []
            for start, end, exposed in self._pending:
                if end.query():
                    seconds = start.elapsed_time(end) / 1000.0
                    stats.copy_s += seconds
                    if exposed:
                        stats.exposed_s += seconds
                else:
                    keep.append((start, end, exposed))
            self._pending = keep
