"""CUDA copies on side streams, and their timing, for the offload tiers.

The rules, written down once here: copies run on a side stream per device; before a copy the side
stream waits for the compute stream (no copy before the tensor is produced); a source tensor gets
``record_stream(side)`` (no free before its copy is done); a tensor coming back waits for its
copy's event on the consumer's stream and gets ``record_stream(consumer)`` (no use before copy).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_mpi.offload.tiers import TierStats


class SideStreams:
    """One side stream per CUDA device, and the stream-safety rules for copies on it."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        return self._side[device]

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue ``dst.copy_(src)`` (device -> pinned host) on the side stream."""
        compute = torch.cuda.current_stream(src.device)  # before switching streams
        side = self.side(src.device)
        side.wait_stream(compute)  # the kernel that produced src has been queued before this
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            dst.copy_(src, non_blocking=True)
            end.record(side)
        # The caller drops its reference now; the caching allocator must not hand src's block
        # to another tensor until the side stream has read it.
        src.record_stream(side)
        return start, end

    def h2d(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event, torch.cuda.Event]:
        """Queue a pinned host -> new device tensor copy on the side stream."""
        side = self.side(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device), torch.cuda.stream(side):
            dev = torch.empty(src.numel(), dtype=torch.uint8, device=device)
            start.record(side)
            dev.copy_(src, non_blocking=True)
            end.record(side)
        return dev, start, end

    @staticmethod
    def hand_over(dev: torch.Tensor, end: torch.cuda.Event) -> bool:
        """Make ``dev`` safe to use on the calling thread's current stream. Returns whether the
        copy was already complete (its time hidden)."""
        done = end.query()
        consumer = torch.cuda.current_stream(dev.device)
        consumer.wait_event(end)  # no use before the copy has landed
        dev.record_stream(consumer)  # allocated on the side stream, freed after consumer work
        return done


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

    def collect(self, stats: TierStats) -> None:
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
