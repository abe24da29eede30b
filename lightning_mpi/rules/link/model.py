"""The link and the schedule it allows, as pure functions: no MPI, no clocks.

A measured link is a :class:`Link`: the seconds an exchange costs are ``latency + bytes / bandwidth``,
where ``bytes`` is what one rank sends for it (:func:`~lightning_mpi.rules.diloco.fragments.exchange_bytes`).
:func:`fit_link` gets one from two timed exchanges (a tiny one gives the latency, one of the real
buffer the bandwidth). :func:`hidden_schedule` turns a link and the compute time of a step into
DiLoCo's period (and Streaming DiLoCo's overlap): the smallest period whose exchange hides
behind that many steps.

Measurements are taken on every rank and agreed before they are used (the maximum over ranks,
:class:`~lightning_mpi.rules.link.probe.LinkProbe`), so these functions see the same numbers on
every rank and return the same schedule: a decision that is never rank-divergent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The share of the inner steps' compute that a blocking exchange (DiLoCo, τ = 0) may cost when
#: ``period="auto"``: "hides behind H steps" read as "costs at most 10% of their time", because
#: a blocking exchange cannot overlap them.
BLOCKING_BUDGET = 0.1
#: The share of the time of its inner steps that overlapped exchanges (Streaming DiLoCo) may keep
#: the link busy: moving bytes costs CPU beside the compute even when it is hidden (measured on 2
#: cores, the exchange's kernel work shares them), so the link is kept at most half busy.
LINK_SHARE = 0.5
#: The smallest period ``period="auto"`` picks. DiLoCo's outer Nesterov step (momentum 0.9, lr 0.7)
#: amplifies a steady pseudo-gradient by lr/(1 − μ) = 7: with a handful of inner steps Δ is close
#: to a gradient step and the outer step overshoots; Douillard et al. report H down to 50 and
#: quality improving as H falls, our tests ran H = 3 to 50 without trouble at W ≤ 4.
MIN_AUTO_PERIOD = 8
#: The largest period ``period="auto"`` picks (Douillard et al.'s H).
MAX_AUTO_PERIOD = 500


@dataclass(frozen=True)
class Link:
    """A measured link between the ranks: ``bandwidth`` in bytes one rank sends per second,
    ``latency`` in seconds per exchange (both > 0)."""

    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        """The seconds an exchange in which one rank sends ``nbytes`` takes."""
        return self.latency + nbytes / self.bandwidth


def fit_link(small_bytes: float, small_seconds: float, big_bytes: float, big_seconds: float) -> Link:
    """The link through two timed exchanges: a tiny one (its time is the latency) and a big one.

    The bandwidth is the big exchange's extra bytes over its extra time; noise that makes the big
    exchange look no slower than the tiny one gives the bandwidth of the big one alone. A
    1 µs floor keeps a latency measured as 0 (a clock's resolution) usable.
    """
    latency = max(small_seconds, 1e-6)
    extra = big_seconds - small_seconds
    if big_bytes <= small_bytes:
        return Link(bandwidth=math.inf, latency=latency)
    if extra <= 0.0:
        extra = max(big_seconds, 1e-6)
    return Link(bandwidth=(big_bytes - small_bytes) / extra, latency=latency)


def hidden_schedule(
    exchange_seconds: float,
    step_seconds: float,
    fragments: int = 1,
    overlap_steps: int = 0,
    *,
    budget: float = BLOCKING_BUDGET,
    link_share: float = LINK_SHARE,
    min_period: int = MIN_AUTO_PERIOD,
    max_period: int = MAX_AUTO_PERIOD,
) -> tuple[int, int]:
    """``(period, overlap_steps)``: the smallest period whose exchanges hide behind its steps.

    ``exchange_seconds`` is one fragment's exchange (after its wire format), ``step_seconds`` the
    compute time of one inner step.

    - Blocking (``overlap_steps == 0``, DiLoCo): the exchange may cost ``budget`` of the period's
      compute: ``H = ceil(t_x / (budget · t_step))``.
    - Overlapped (Streaming DiLoCo, ``overlap_steps ≥ 1``): each fragment's exchange must arrive
      within τ steps, so τ is raised to ``ceil(t_x / t_step)`` where the given one is too short;
      the P fragments take turns every H/P steps and τ < H/P, so ``H ≥ P · (τ + 1)``, and the
      link may be busy ``link_share`` of the time: ``H ≥ P · t_x / (link_share · t_step)``.

    The period is then clipped to ``[max(min_period, P·(τ + 1)), max_period]`` and rounded up to a
    multiple of P (every fragment gets the same number of steps).
    """
    if step_seconds <= 0.0 or not math.isfinite(step_seconds):
        raise ValueError(f"step_seconds={step_seconds!r} must be a positive number of seconds")
    if fragments < 1 or overlap_steps < 0:
        raise ValueError(f"fragments={fragments!r} must be >= 1 and overlap_steps={overlap_steps!r} >= 0")
    steps_per_exchange = exchange_seconds / step_seconds
    if overlap_steps == 0:
        wanted = math.ceil(steps_per_exchange / budget) if math.isfinite(steps_per_exchange) else max_period
        tau = 0
    else:
        tau = max(overlap_steps, math.ceil(min(steps_per_exchange, max_period)))
        tau = min(tau, max(1, max_period // fragments - 1))
        busy = fragments * steps_per_exchange / link_share
        wanted = max(fragments * (tau + 1), math.ceil(min(busy, max_period)))
    floor = max(min_period, fragments * (tau + 1))
    period = min(max(wanted, floor), max(max_period, floor))
    period = -(-period // fragments) * fragments
    return int(period), int(tau)


def exposed_seconds(exchange_seconds: float, hidden_behind: float) -> float:
    """The part of an exchange that compute of ``hidden_behind`` seconds cannot hide."""
    return max(0.0, exchange_seconds - hidden_behind)
