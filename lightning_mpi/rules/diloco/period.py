"""DiLoCo's ``period``: the option's values, and ``period="auto"``'s choice from measurements.

``period="auto"`` lets the first :data:`AUTO_PROBE_STEPS` + 1 inner steps run without an
exchange, times their compute (the rule's :class:`~lightning_mpi.rules.link.probe.StepClock`), then times the real
exchange of the largest fragment (:class:`~lightning_mpi.rules.link.probe.LinkProbe`, agreed over the ranks) and
asks :func:`~lightning_mpi.rules.link.model.hidden_schedule` for the smallest period, and the overlap, that hide
that exchange behind the steps. Every rank gets the same numbers, so every rank fixes the same
schedule; the rule then saves it in its checkpoints (:func:`.state.save_schedule`),
so a resumed run does not choose again from another moment's link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.diloco.fragments import OuterFragment
from lightning_mpi.rules.link.model import hidden_schedule
from lightning_mpi.rules.link.probe import LinkProbe, Measurement

#: Inner steps timed before ``period="auto"`` decides (the first step, which warms caches and
#: allocators, is not timed).
AUTO_PROBE_STEPS = 4


def check_period(name: str, value: Any) -> int | str | None:
    """The ``period`` option's check: an integer ≥ 1, ``"auto"``, or None (the wire's default)."""
    if value == "auto" or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name}={value!r} is out of range: it must be an integer >= 1, "auto" or None')
    return value


def choose_period(
    fragments: Sequence[OuterFragment],
    team: Transport,
    progress: ExchangeScheduler,
    step_seconds: float,
    overlap_steps: int,
) -> tuple[Measurement, int, int]:
    """Collective over ``team``: ``(measured, period, overlap_steps)`` for the schedule.

    Times the real exchange of the largest fragment with Δ = 0, which leaves its error-feedback
    residuals at zero (the training has not exchanged yet, so nothing is lost), on ``progress``,
    the scheduler the rule's own exchanges run on."""
    largest = max(fragments, key=lambda f: f.bytes_per_exchange)
    largest.delta.zero_()

    def exchange() -> None:
        progress.start(largest.mean_steps(team))
        progress.wait_all()

    measured = LinkProbe(team).measure(step_seconds, exchange, largest.bytes_per_exchange)
    link_seconds = measured.link.seconds(largest.bytes_per_exchange)
    period, tau = hidden_schedule(link_seconds, measured.step_seconds, len(fragments), overlap_steps)
    return measured, period, tau
