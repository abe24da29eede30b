"""What ``mpi_auto`` says about its decisions (:mod:`.auto`): rank 0's one line per decision that
changed the arm (and for the first decision, and the first after a heal), and the ``mpi/auto/*``
numbers of its ``stats()``. Pure: the caller prints and logs them."""

from __future__ import annotations

from lightning_mpi.rules.auto_choice import Choice
from lightning_mpi.rules.link_probe import Measurement

#: The arm in use as a number, for the logs.
ARM_CODES = {"probing": -1.0, "sync": 0.0, "powersgd": 1.0, "streaming": 2.0}
#: Bits per value of a choice's wire, for the logs (0: the arm has no wire setting).
WIRE_BITS = {"": 0.0, "fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}


def announcement(steps: int, choice: Choice, reason: str, measured: Measurement | None) -> str:
    """The line announcing ``choice`` after ``steps`` steps, why, and what it was measured on."""
    link = measured.link if measured is not None else None
    seen = "" if link is None else f"; link {link.bandwidth * 8 / 1e6:.0f} Mbit/s, {link.latency * 1e3:.2f} ms"
    step = "" if measured is None else f", step {measured.step_seconds * 1e3:.0f} ms"
    return f"lightning_mpi: mpi_auto after step {steps}: {choice.describe()} ({reason}{seen}{step})"


def decision_stats(
    choice: Choice, switches: int, decisions: int, observed_share: float, measured: Measurement | None
) -> dict[str, float]:
    """The decisions' numbers: the arm in use and its settings, the switches and decisions made,
    the share of a step the arm in use was seen to expose, and the last measurement (where there
    was one)."""
    stats = {
        "arm": ARM_CODES[choice.arm],
        "wire_bits": WIRE_BITS.get(choice.wire, 0.0),
        "fragments": float(choice.fragments),
        "period": float(choice.period),
        "overlap_steps": float(choice.overlap_steps),
        "switches": float(switches),
        "decisions": float(decisions),
        "observed_exposed_share": observed_share,
    }
    if measured is not None:
        stats.update(
            step_seconds=measured.step_seconds,
            link_bandwidth=measured.link.bandwidth,
            link_latency=measured.link.latency,
        )
    return stats
