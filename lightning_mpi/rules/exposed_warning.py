"""A warning, once and on rank 0, where an every-step exchange leaves W ranks slower than one process.

The every-step rules (``mpi_allreduce``, the ``mpi_asa*`` rules, the compressed rules,
``mpi_powersgd``) start their exchange in backward and, before the optimizer step, wait for what
is still on the wire. When that wait (the exchange's exposed time) is at least ``W − 1`` times the
compute of a step, W ranks together take no more samples per second than one process without any
exchange, and the effective speedup is below 1 whatever a larger batch is worth per sample: the
run would be as fast on one of its ranks. Measured on the time-to-quality task, 2 ranks on shared
memory of a 2-core machine (docs/performance.md): every-step fp16 ASA reached an effective speedup
of 0.41, and Lightning's ``ddp`` with ``fp16_compress_hook`` 0.61.

The check reads only rank 0's own clock (no collective, so it cannot change what any rank does):
the medians, over :data:`WINDOW` steps after :data:`WARMUP` steps, of the time from the end of one
optimizer step to the start of the wait (forward and backward, with whatever the exchange's hooks
do during backward: counted as compute, so the check errs on the side of silence) and of the wait
itself.
"""

from __future__ import annotations

import statistics
import time
import warnings

#: Steps not timed at the start (allocators, caches and the first exchanges warm up).
WARMUP = 5
#: Steps whose medians decide.
WINDOW = 16


def exposed_exchange_message(exchange: str, exposed_seconds: float, compute_seconds: float, world: int) -> str | None:
    """The warning's text where the wait is at least ``world − 1`` times a step's compute, else None."""
    if world < 2 or exposed_seconds < (world - 1) * compute_seconds:
        return None
    return (
        f"lightning_mpi: {exchange} adds {exposed_seconds * 1e3:.0f} ms of waiting to each step, whose forward and "
        f"backward take {compute_seconds * 1e3:.0f} ms: {world} ranks process fewer samples per second than one "
        f"process without any exchange, so this run is slower than it would be on one rank. Use mpi_auto (it "
        f"measures this and trains with PowerSGD or Streaming DiLoCo where every-step exchanges do not hide), "
        f"mpi_streaming_diloco on links of 1 Gbit/s and slower, or a larger batch per rank (more compute per exchange)."
    )


class ExposedExchangeWarning:
    """Times rank 0's steps and warns once where :func:`exposed_exchange_message` has something to say.

    Call :meth:`wait_begins` where the rule starts waiting for its exchange before the optimizer
    step, :meth:`wait_ends` where that wait is over, and :meth:`step_ends` after the optimizer
    step. ``clock`` is injectable for tests. Disarmed on other ranks, on one rank, and once it has
    decided (warned or not)."""

    def __init__(self, exchange: str, rank: int, world: int, clock=time.perf_counter) -> None:
        self.exchange = exchange
        self.world = world
        self.armed = rank == 0 and world > 1
        self.warned = False
        self._clock = clock
        self._compute: list[float] = []
        self._exposed: list[float] = []
        self._step_end: float | None = None
        self._wait_begin: float | None = None
        self._steps = 0

    def disarm(self) -> None:
        """Never warn (a rule that chooses its own exchange, ``mpi_auto``, runs this one as an arm)."""
        self.armed = False

    def wait_begins(self) -> None:
        if not self.armed:
            return
        now = self._clock()
        if self._step_end is not None and self._steps >= WARMUP:
            self._compute.append(now - self._step_end)
        self._wait_begin = now

    def wait_ends(self) -> None:
        if not self.armed or self._wait_begin is None:
            return
        if self._steps >= WARMUP and len(self._exposed) < len(self._compute):
            self._exposed.append(self._clock() - self._wait_begin)
        self._wait_begin = None

    def step_ends(self) -> None:
        if not self.armed:
            return
        self._steps += 1
        self._step_end = self._clock()
        if len(self._exposed) >= WINDOW:
            self.armed = False  # decided: the check costs nothing from here on
            message = exposed_exchange_message(
                self.exchange, statistics.median(self._exposed), statistics.median(self._compute), self.world
            )
            if message is not None:
                self.warned = True
                warnings.warn(message, RuntimeWarning, stacklevel=3)
