"""Measuring what a schedule needs on the running job: the compute time of a step and the link.

:class:`StepClock` times the compute of each step (from the end of one step's exchange hooks to the
start of the next one's: forward, backward, data loading). :class:`LinkProbe` times a tiny
Allreduce (the latency) and the real exchange (the bandwidth), and agrees the numbers over the
ranks (the maximum of each, one Allreduce), so that every rank feeds the same numbers to the pure
functions of :mod:`lightning_mpi.rules.link.model` and reaches the same decision.

The probe is a collective: every rank must call :meth:`LinkProbe.measure` at the same step. It
joins the same collectives in the same order on every rank: it starts with a barrier (so that no
rank's timing holds the others' arrival), and how many times an exchange is timed is decided
from its first time agreed over the ranks, never from a rank's own clock. (A rank that decided
from its own clock, when it had waited for a late rank, timed once where the others timed three
times, and the job hung in mismatched Allreduces: issue 25.)
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.link.model import Link, fit_link


class StepClock:
    """The compute seconds of the last ``window`` steps: :meth:`resume` when compute starts (the
    rule's hooks return), :meth:`pause` when it ends (the rule is called again)."""

    def __init__(self, window: int = 16) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self._since: float | None = None

    def resume(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self.samples.append(time.perf_counter() - self._since)
            self._since = None

    def seconds(self) -> float | None:
        """The median compute time of a step over the window (None before any step was timed)."""
        return statistics.median(self.samples) if self.samples else None


@dataclass(frozen=True)
class Measurement:
    """What a decision is made from, the same on every rank: the compute seconds of a step and the link."""

    step_seconds: float
    link: Link

    def as_dict(self) -> dict[str, float]:
        return {
            "step_seconds": self.step_seconds,
            "bandwidth": self.link.bandwidth,
            "latency": self.link.latency,
        }

    @classmethod
    def from_dict(cls, saved: dict[str, float]) -> Measurement:
        return cls(float(saved["step_seconds"]), Link(float(saved["bandwidth"]), float(saved["latency"])))


class LinkProbe:
    """Times exchanges over ``transport`` and agrees the results (module docstring).

    Args:
        transport: the ranks whose link is measured (the communicator the exchanges will use).
        repeat_below: an exchange whose first run took less than this many seconds on every rank
            is timed three times (the fastest counts); a slower one once, so that a probe on a slow
            link costs one exchange.
    """

    def __init__(self, transport: Transport, repeat_below: float = 0.25) -> None:
        self.transport = transport
        self.repeat_below = repeat_below

    def _timed(self, run: Callable[[], object]) -> float:
        """Collective: the seconds ``run`` (a collective) takes, the fastest of three where its first
        run was fast on every rank. Whether to repeat is decided from the first time agreed over
        the ranks (its maximum), so that every rank runs ``run`` equally often."""
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
        slowest = first
        if self.transport.size > 1:
            agreed = torch.tensor([first], dtype=torch.float64)
            slowest = float(self.transport.allreduce_(agreed, "max")[0])
        if slowest >= self.repeat_below:
            return first
        times = [first]
        for _ in range(2):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    def measure(self, step_seconds: float, exchange: Callable[[], object], nbytes: int) -> Measurement:
        """Collective. Time a tiny Allreduce and ``exchange`` (one rank sends ``nbytes`` in it), then
        agree ``step_seconds`` and both times over the ranks (their maxima)."""
        if self.transport.size > 1:
            # Ranks arrive apart (they stepped on their own, or one was slow): wait here, so that
            # the first timed Allreduce times the link, not the latest rank's arrival.
            self.transport.barrier()
        tiny = torch.zeros(1, dtype=torch.float32)
        small = self._timed(lambda: self.transport.allreduce_(tiny))
        big = self._timed(exchange)
        agreed = torch.tensor([step_seconds, small, big], dtype=torch.float64)
        if self.transport.size > 1:
            self.transport.allreduce_(agreed, "max")
        step, small, big = (float(v) for v in agreed)
        small_bytes = 2 * (self.transport.size - 1) / max(1, self.transport.size) * 4
        return Measurement(step, fit_link(small_bytes, small, float(nbytes), big))
