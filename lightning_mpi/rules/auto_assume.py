"""``mpi_auto``'s ``assume`` option: fixed measurements instead of timed ones, one per decision (the
last repeats), so that a test or a what-if run decides from numbers it chose (:mod:`.auto`)."""

from __future__ import annotations

from lightning_mpi.rules.link_model import Link
from lightning_mpi.rules.link_probe import Measurement


def parse_assumed(text: str) -> list[Measurement]:
    """``"step_ms,mbit_per_s,latency_ms;..."`` -> one :class:`Measurement` per decision.

    Raises:
        ValueError: naming ``assume``, when an entry is not three positive numbers.
    """
    found = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        try:
            step_ms, mbit, latency_ms = (float(v) for v in entry.split(","))
        except ValueError:
            step_ms = mbit = latency_ms = -1.0
        if min(step_ms, mbit, latency_ms) <= 0:
            raise ValueError(
                f"assume={text!r}: each entry must be 'step_ms,mbit_per_s,latency_ms' with positive numbers, "
                f"';'-separated (e.g. '50,1000,0.1;50,100,0.5'); got {entry!r}"
            )
        found.append(Measurement(step_ms / 1e3, Link(mbit * 1e6 / 8, latency_ms / 1e3)))
    if not found:
        raise ValueError(f"assume={text!r} holds no measurement: pass e.g. '50,1000,0.1' or None")
    return found
