"""How ``mpi_auto``'s survivors agree, after a heal, on the arm they bind and on the step of their
next decision: :func:`agree_after_heal`, a pure function of what each survivor kept (no MPI), and
:func:`plan_after_heal`, which gathers that over the healed run and says what this survivor binds
and loads (:meth:`~.rule.BoundAuto.load_state_dict` applies it).

Each survivor kept, at the moment it noticed the loss, ``(decisions, steps, deciding)``: the
decisions it completed, the steps it counted, and whether it was inside a decision (then what it
kept is the state that decision started from). ULFM does not fail a collective on every rank
alike, so survivors may be one healing operation apart (:mod:`lightning_mpi.strategies.healing`):
one may have completed a decision that another was still in. Then:

- someone completed the decision (``decisions`` one higher than those inside it): every survivor
  binds that survivor's arm; those inside the decision take its result (the new arm's state, the
  weights and optimizer state the switch left) from it, and the next decision comes at the step
  after the furthest survivor's: a re-decision over the survivors (the world size and the link
  changed);
- nobody completed it: the survivors inside it redo it over the survivors, and those not yet in it
  reach it at the same step: the next decision is at that step;
- nobody was inside a decision: the re-decision comes at the step after the furthest survivor's
  (a survivor one step behind counts that step first), never before the first steps are measured.

Every survivor binds the same arm (binding is collective: it duplicates the communicator), sets
its count of decisions to the highest, and drops what it observed of the arms' costs (made at the
old world size; the dry runs time them again), so that every input of the next choice is agreed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.auto.choice import Choice


def agree_after_heal(kept: Sequence[tuple[int, int, bool]], probe_steps: int) -> tuple[int, int, int]:
    """``kept``: per survivor ``(decisions, steps, deciding)``; returns ``(source, decisions,
    next_decision)``: the survivor whose arm every survivor binds, the count of decisions every
    survivor takes, and the step of the next decision (module docstring).

    Raises:
        ValueError: ``kept`` is empty, or survivors are more than one decision apart (they are at
            most one healing operation apart; the heal stops before this when they are not).
    """
    if not kept:
        raise ValueError("agree_after_heal: no survivor's state (kept is empty)")
    top = max(decisions for decisions, _, _ in kept)
    if any(decisions < top - 1 for decisions, _, _ in kept):
        raise ValueError(f"agree_after_heal: survivors more than one decision apart: {[k[0] for k in kept]}")
    inside = [i for i, (decisions, _, deciding) in enumerate(kept) if deciding and decisions == top]
    if inside:  # nobody completed the decision in progress: it is redone, at its step
        source = inside[0]
        return source, top, kept[source][1]
    source = next(i for i, (decisions, _, deciding) in enumerate(kept) if decisions == top and not deciding)
    furthest = max(steps for _, steps, _ in kept)
    return source, top, max(furthest + 1, probe_steps if top == 0 else 0)


@dataclass(frozen=True)
class HealedPlan:
    """What one survivor binds and schedules on the healed run (:func:`plan_after_heal`)."""

    #: the arm every survivor binds
    choice: Choice
    #: the count of decisions every survivor takes
    decisions: int
    #: the step of the next decision, the same on every survivor
    next_decision: int
    #: this survivor's kept state of that arm (its own part under ``"local"``); ``None`` where it
    #: kept another arm: it was inside the decision that switched, and takes that decision's result
    #: from a survivor that completed it
    arm_state: dict[str, Any] | None


def plan_after_heal(transport: Transport, kept: dict[str, Any], probe_steps: int) -> HealedPlan:
    """Collective over the healed run (``transport``): every survivor's ``kept`` state (what
    ``mpi_auto`` kept through the heal: its decisions' counters, ``"deciding"``, its arm's state
    under ``"inner"`` and ``"local"``) gathered and agreed with :func:`agree_after_heal`."""
    mine = (int(kept["decisions"]), int(kept["steps"]), bool(kept.get("deciding")), kept["choice"])
    everyone = transport.allgather_object(mine) if transport.size > 1 else [mine]
    source, decisions, next_decision = agree_after_heal([entry[:3] for entry in everyone], probe_steps)
    choice = Choice.from_dict(everyone[source][3])
    arm_state = None
    if Choice.from_dict(kept["choice"]) == choice:
        arm_state = dict(kept["inner"])
        if "local" in kept:
            arm_state["local"] = kept["local"]
    return HealedPlan(choice, decisions, next_decision, arm_state)
