"""``mpi_auto`` deciding from fixed measurements instead of timed ones, for tests: one per decision
(the last repeats), so that a test decides from numbers it chose.

The package has no option for it: :func:`assumed` patches, in this process (a test, or a script
run under mpiexec on every rank: ``from auto_assumed import assumed``, beside the scripts; a test
process imports ``tests.scripts.auto_assumed``), the rule's measurement
(:meth:`~lightning_mpi.rules.auto.rule.BoundAuto._measure`: no link probe, no dry runs, nothing
observed) and the interval between decisions (``measure_every`` as given, not spaced out for a
slow link's probe).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from lightning_mpi.rules.auto import rule
from lightning_mpi.rules.link.model import Link
from lightning_mpi.rules.link.probe import Measurement


def parse_assumed(assume: str) -> list[Measurement]:
    """``"step_ms,mbit_per_s,latency_ms;..."`` -> one :class:`Measurement` per decision.

    Raises:
        ValueError: naming ``assume``, when an entry is not three positive numbers.
    """
    found = []
    for entry in filter(None, (e.strip() for e in assume.split(";"))):
        try:
            step_ms, mbit, latency_ms = (float(v) for v in entry.split(","))
        except ValueError:
            step_ms = mbit = latency_ms = -1.0
        if min(step_ms, mbit, latency_ms) <= 0:
            raise ValueError(
                f"assume={assume!r}: each entry must be 'step_ms,mbit_per_s,latency_ms' with positive numbers, "
                f"';'-separated (e.g. '50,1000,0.1;50,100,0.5'); got {entry!r}"
            )
        found.append(Measurement(step_ms / 1e3, Link(mbit * 1e6 / 8, latency_ms / 1e3)))
    if not found:
        raise ValueError(f"assume={assume!r} holds no measurement: pass e.g. '50,1000,0.1'")
    return found


@contextmanager
def assumed(assume: str) -> Iterator[list[Measurement]]:
    """While inside: every ``mpi_auto`` decision in this process takes the measurements ``assume``
    lists (:func:`parse_assumed`), the ``n``-th decision the ``n``-th (the last repeats)."""
    measurements = parse_assumed(assume)

    def measure(self: Any) -> tuple[Measurement, float | None]:
        return measurements[min(self.decisions, len(measurements) - 1)], None

    def interval(every: int, *_: Any) -> int:
        return every

    with mock.patch.object(rule.BoundAuto, "_measure", measure), mock.patch.object(rule, "measure_interval", interval):
        yield measurements
