"""What DiLoCo's checkpoint and heal state hold of the outer loop, and how each part is put back.

:class:`~lightning_mpi.rules.diloco.BoundDiLoCo` saves two kinds of state, built from the parts
here (the rule decides when, and runs the collectives; everything here is local to one rank):

- ``state_dict()`` (a checkpoint: exact, a resumed run retraces the uninterrupted one)::

      {"steps", "outer_steps", "world_size",
       "fragments": [save_fragment(...), ...],        # replicated: the same on every rank
       "ranks": [{weights, optimizer, residuals, owner_residuals}, ...],   # every rank's own
       "schedule": save_schedule(...)}

- ``heal_state()`` (what a survivor carries into a healed run; no collective)::

      {"steps", "outer_steps", "world_size",
       "fragments": [save_fragment(..., healing=True), ...],   # with "sent": Δ of an exchange in flight
       "local": {"residuals": [...], "skipped_steps": k},      # this rank's own
       "schedule": save_schedule(...)}

Each fragment's entry holds θ_global and the outer momentum buffer (unpadded), the mean Δ when
it has ``arrived`` (applied at its ``due`` step after a resume, as the uninterrupted run would),
and the step its last exchange ``started``. Padding is not saved: buffers are padded for the
world size, which a resume or a heal may change, and padding is always zero. What only a heal
needs (an exchange in flight, a rank that joins) is :mod:`.outer_heal`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.rules.link_probe import Measurement
from lightning_mpi.rules.outer_fragment import OuterFragment


def save_fragment(
    fragment: OuterFragment, outer: Optimizer, healing: bool = False, sent: Tensor | None = None
) -> dict[str, Any]:
    """One fragment's replicated outer state. ``healing``: with ``"sent"``, the Δ an exchange in
    flight started from (``None`` when none is), for the survivors to start it again."""
    n = fragment.numel
    buffer = outer.state.get(fragment.theta_global, {}).get("momentum_buffer")
    entry: dict[str, Any] = {
        "theta_global": fragment.theta_global[:n].clone(),
        "momentum": None if buffer is None else buffer[:n].clone(),
        "arrived": fragment.delta[:n].clone() if fragment.status == "arrived" else None,
    }
    if healing:
        entry["sent"] = None if sent is None else sent[:n].clone()
    entry.update(due=fragment.due, started=fragment.started)
    return entry


def load_fragment(fragment: OuterFragment, outer: Optimizer, saved: dict[str, Any]) -> None:
    """Put back what :func:`save_fragment` saved: θ_global, the momentum, the schedule of its
    exchange, and an arrived Δ (status ``arrived``; otherwise ``idle``)."""
    n = fragment.numel
    fragment.theta_global.zero_()
    fragment.theta_global[:n].copy_(saved["theta_global"])
    if saved["momentum"] is not None:
        buffer = torch.zeros_like(fragment.theta_global)
        buffer[:n].copy_(saved["momentum"])
        outer.state[fragment.theta_global] = {"momentum_buffer": buffer}
    fragment.started, fragment.due = int(saved["started"]), int(saved["due"])
    fragment.status = "idle"
    if saved["arrived"] is not None:
        fragment.delta.zero_()
        fragment.delta[:n].copy_(saved["arrived"])
        fragment.status = "arrived"


def save_residuals(fragments: Sequence[OuterFragment]) -> dict[str, list[Tensor | None]]:
    """This rank's error-feedback residuals of every fragment, padded as they are (a checkpoint
    restores them only at the same world size, where the padding is the same)."""
    return {
        "residuals": [None if f.residual is None else f.residual.clone() for f in fragments],
        "owner_residuals": [None if f.owner_residual is None else f.owner_residual.clone() for f in fragments],
    }


def load_residuals(fragment: OuterFragment, index: int, mine: dict[str, Any]) -> None:
    """Fragment ``index``'s residuals from this rank's entry of a checkpoint (same world size)."""
    for name in ("residual", "owner_residual"):
        saved = mine[f"{name}s"][index]
        target = getattr(fragment, name)
        if target is not None and saved is not None:
            target.copy_(saved)


def save_schedule(
    period: int | None, overlap_steps: int, offsets: Sequence[int], measured: Measurement | None
) -> dict[str, Any]:
    """The schedule in use: with ``period="auto"`` it was chosen from measurements, and a resumed
    run must keep it (measuring again would choose from another moment's link)."""
    return {
        "period": period,
        "overlap_steps": overlap_steps,
        "offsets": list(offsets),
        "measured": None if measured is None else measured.as_dict(),
    }


def load_schedule(schedule: dict[str, Any] | None) -> tuple[int, int, list[int], Measurement | None] | None:
    """``(period, overlap_steps, offsets, measured)`` that the saved run chose, or ``None`` where
    it had none to save (an older checkpoint, or one written while ``"auto"`` was measuring)."""
    if schedule is None or schedule["period"] is None:
        return None
    measured = schedule.get("measured")
    return (
        int(schedule["period"]),
        int(schedule["overlap_steps"]),
        [int(o) for o in schedule["offsets"]],
        None if measured is None else Measurement.from_dict(measured),
    )
