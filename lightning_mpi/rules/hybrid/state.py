"""What the two-level rule's checkpoint and heal state hold, and how each part is put back.

:class:`~lightning_mpi.rules.hybrid.rule.BoundHybrid` saves (the rule runs the collectives;
everything here is local to one rank):

- ``state_dict()`` (a checkpoint: exact, a resumed run retraces the uninterrupted one)::

      {"steps", "outer_steps", "world_size",
       "fragments": [save_fragment(...), ...],      # the outer state: the same on every rank
       "layout": {"table": [replica of each rank]},
       "replicas": [{weights, optimizer}, ...],      # each replica's own (its first member's copy)
       "ranks": [{residuals, inner}, ...]}           # each rank's own: its pieces' residuals

- ``heal_state()`` (what a survivor carries into a healed run; no collective)::

      {"steps", "outer_steps", "world_size",
       "fragments": [save_fragment(..., sent=Δ of an exchange in flight), ...],
       "local": {"inner_steps", "last_inner", "inner"}}   # this rank's own

The members of a replica hold the same weights and inner-optimizer state (they synchronize every
step), so a checkpoint carries one copy per replica, where flat DiLoCo carries one per rank.
Residuals (SparseLoCo's accumulators among them) belong to the pieces a rank carries, which the
layout decides: a checkpoint restores them at the same layout (the same replicas of the same
ranks), and they start at zero otherwise, and after every heal (which changes the layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.rules.hybrid.pieces import ReplicaFragment


def save_fragment(fragment: ReplicaFragment, outer: Optimizer, sent: Tensor | None = None) -> dict[str, Any]:
    """One fragment's outer state (unpadded): θ_global, the outer momentum, an arrived mean Δ (used
    at its ``due`` step after a resume), the schedule of its exchange, and (a heal) the Δ an exchange
    in flight started from, under ``"sent"``."""
    n = fragment.numel
    buffer = outer.state.get(fragment.theta_global, {}).get("momentum_buffer")
    return {
        "theta_global": fragment.theta_global[:n].clone(),
        "momentum": None if buffer is None else buffer[:n].clone(),
        "arrived": fragment.delta[:n].clone() if fragment.status == "arrived" else None,
        "sent": None if sent is None else sent[:n].clone(),
        "due": fragment.due,
        "started": fragment.started,
    }


def load_fragment(fragment: ReplicaFragment, outer: Optimizer, saved: dict[str, Any]) -> bool:
    """Put back what :func:`save_fragment` saved; returns whether an exchange was in flight (its Δ
    is then back in ``delta``, and the caller starts it again)."""
    n = fragment.numel
    fragment.theta_global.zero_()
    fragment.theta_global[:n].copy_(saved["theta_global"])
    if saved["momentum"] is not None:
        buffer = torch.zeros_like(fragment.theta_global)
        buffer[:n].copy_(saved["momentum"])
        outer.state[fragment.theta_global] = {"momentum_buffer": buffer}
    else:
        outer.state.pop(fragment.theta_global, None)
    fragment.started, fragment.due = int(saved["started"]), int(saved["due"])
    fragment.status = "idle"
    for key, status in (("arrived", "arrived"), ("sent", "restart")):
        if saved.get(key) is not None:
            fragment.delta.zero_()
            fragment.delta[:n].copy_(saved[key])
            fragment.status = status
    return fragment.status == "restart"


def local_weights(fragments: list[ReplicaFragment]) -> list[Tensor]:
    """This replica's weights, one flat unpadded tensor per fragment (copies)."""
    return [f.local.pull()[: f.numel].clone() for f in fragments]


def load_local_weights(fragments: list[ReplicaFragment], saved: list[Tensor]) -> None:
    """Put a replica's saved weights into the parameters."""
    for fragment, weights in zip(fragments, saved, strict=True):
        if weights.numel() != fragment.numel:
            raise ValueError(
                f"lightning_mpi: a checkpoint's replica weights hold {weights.numel()} values where this fragment "
                f"has {fragment.numel}; resume with the model and fragments the checkpoint was written with"
            )
        flat = fragment.local.pull()
        flat[: fragment.numel].copy_(weights)
        fragment.local.push()
