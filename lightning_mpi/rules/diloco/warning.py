"""A warning, once and on rank 0, where a blocking outer exchange costs more than it can buy.

DiLoCo (``mpi_diloco``, τ = 0) stops every rank for its exchange of Δ, every ``period`` steps.
When that exchange takes a large share of the compute of the steps between two exchanges, two
ranks together process too few samples for DiLoCo's quality per sample to beat one process
given the same time. Measured on the time-to-quality task (2 simulated hosts, T = 15 s,
docs/performance.md): at 1 Gbit/s the default exchange (66 MB fp32) took about 12% of the 50
steps' compute and the effective speedup was 1.10; at 100 Mbit/s it took about 120% and the
effective speedup was 0.55, below one process. :data:`WARN_SHARE` sits between the two: past
it, W = 2 ranks make fewer than 1/(1 + 0.5) · 2 = 1.33 times one process's steps, and DiLoCo's
steps are worth less than one process's.

The check uses the exchange that rank 0 saw (no collective, so it cannot change what any rank
does) and the compute seconds of a step from the rule's :class:`~lightning_mpi.rules.link.probe.StepClock`.
"""

from __future__ import annotations

import warnings

#: The share of the compute between two exchanges past which a blocking exchange warns.
WARN_SHARE = 0.5


def exchange_share(exchange_seconds: float, step_seconds: float, period: int) -> float:
    """What a blocking exchange adds to the ``period`` steps between two, as a share of their compute."""
    return exchange_seconds / max(step_seconds * period, 1e-9)


def slow_exchange_message(
    strategy: str, exchange_seconds: float, step_seconds: float, period: int, wire: str
) -> str | None:
    """The warning's text where the exchange is past :data:`WARN_SHARE` of the steps' compute, else None."""
    share = exchange_share(exchange_seconds, step_seconds, period)
    if share <= WARN_SHARE:
        return None
    return (
        f"lightning_mpi: {strategy}'s blocking exchange (wire={wire}) took {exchange_seconds:.2f} s, {share:.0%} of "
        f"the compute of the {period} steps between two ({step_seconds * 1e3:.0f} ms each): the ranks wait more "
        f"than they train, and on a link like this DiLoCo at its defaults was measured slower than one process "
        f"(effective speedup 0.55 at 100 Mbit/s on 2 hosts, docs/performance.md). Use mpi_streaming_diloco "
        f"(4-bit fragments, overlapped with the steps) or mpi_auto; or pass period='auto', or wire='int4' with a "
        f"larger period."
    )


class SlowExchangeWarning:
    """Warns once, on rank 0, the first time :func:`slow_exchange_message` has something to say."""

    def __init__(self, strategy: str, rank: int, wire: str) -> None:
        self.strategy = strategy
        self.wire = wire
        self.armed = rank == 0
        self.warned = False

    def check(self, exchange_seconds: float, step_seconds: float | None, period: int) -> None:
        if not self.armed or self.warned or step_seconds is None:
            return
        message = slow_exchange_message(self.strategy, exchange_seconds, step_seconds, period, self.wire)
        if message is not None:
            self.warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=3)
