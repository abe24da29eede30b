"""What ``mpi_auto``'s checkpoint and heal state hold of its decisions, and how they are put back.

:class:`~lightning_mpi.rules.auto.BoundAuto` saves its decisions' counters (:func:`save_counters`,
read on this rank alone) beside its arm's own state:

- ``state_dict()`` (a checkpoint: a resumed run binds the same arm and loads its state)::

      {"choice", "steps", "next_decision", "decisions", "switches", "measured", "observed",
       "inner": the arm's state_dict()}

- what a survivor keeps through a heal (:func:`~lightning_mpi.strategies.healing_auto.auto_kept_state`)::

      {<the counters>, "healed": True, "deciding": inside a decision?,
       "inner": the arm's kept state, "local": this rank's own part of it (where the arm has one)}

  loaded on the healed run as the survivors agree (:func:`~.auto_heal.plan_after_heal`).

The arm in use is saved with the counters but bound by the rule (binding is collective), so
:func:`load_counters` puts back everything but it.
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning_mpi.rules.auto_choice import Choice
from lightning_mpi.rules.link_probe import Measurement


class DecisionCounters(Protocol):
    """What :func:`save_counters` reads and :func:`load_counters` writes (a ``BoundAuto``)."""

    choice: Choice
    steps: int
    next_decision: int
    decisions: int
    switches: int
    measured: Measurement | None
    observed: dict[str, tuple[float, float]]


def save_counters(auto: DecisionCounters) -> dict[str, Any]:
    """The decisions' state, without the arm's: the arm in use, the steps counted, the step of the
    next decision (-1: none), the decisions and switches made, the last measurement, and the arms'
    observed costs (arm -> exposed seconds per step, the bandwidth then)."""
    return {
        "choice": auto.choice.as_dict(),
        "steps": auto.steps,
        "next_decision": auto.next_decision,
        "decisions": auto.decisions,
        "switches": auto.switches,
        "measured": None if auto.measured is None else auto.measured.as_dict(),
        "observed": {arm: list(seen) for arm, seen in auto.observed.items()},
    }


def load_counters(auto: DecisionCounters, saved: dict[str, Any]) -> None:
    """Put back what :func:`save_counters` saved, all but the arm in use (``"measured"`` and
    ``"observed"`` may be missing: none)."""
    auto.steps = int(saved["steps"])
    auto.next_decision = int(saved["next_decision"])
    auto.decisions = int(saved["decisions"])
    auto.switches = int(saved["switches"])
    measured = saved.get("measured")
    auto.measured = None if measured is None else Measurement.from_dict(measured)
    auto.observed = {arm: (float(s), float(b)) for arm, (s, b) in saved.get("observed", {}).items()}
