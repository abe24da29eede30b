"""What DiLoCo's checkpoint and heal state hold, and how each part is put back: the outer loop's
replicated state, and every rank's own replica.

:class:`~lightning_mpi.rules.diloco.rule.BoundDiLoCo` saves two kinds of state, built from the parts
here (the rule decides when, and runs the collectives; everything here but
:meth:`ReplicaState.gather` is local to one rank):

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
needs (an exchange in flight, a rank that joins) is in :mod:`.rule`.

Every rank's own training state. Between two exchanges each rank holds its own weights and its own
inner-optimizer state (SGD momentum, Adam moments). A Lightning checkpoint holds rank 0's copy of
both, so a run resumed mid-period would restart every rank from rank 0's weights and moments, and
would not retrace the uninterrupted run. :class:`ReplicaState` carries every rank's copy instead
(the ``"ranks"`` above):

- :meth:`ReplicaState.gather` (collective) returns every rank's weights and inner-optimizer state;
- :meth:`ReplicaState.restore` puts this rank's weights back at once, and keeps its optimizer state
  for :meth:`ReplicaState.apply_pending`, which the rule calls at the next step, once Lightning or
  Fabric has loaded rank 0's optimizer state (which it then replaces).

Only the state of the rule's own parameters is carried; the optimizer's hyperparameters
(``param_groups``) are the same on every rank and come from the checkpoint as usual.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.diloco.fragments import OuterFragment
from lightning_mpi.rules.link.probe import Measurement


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


# -- every rank's own replica (module docstring) ----------------------------------------------------
def optimizer_state_of(optimizer: Optimizer | None, params: Sequence[Tensor]) -> list[dict[str, Any]]:
    """The optimizer's per-parameter state for each of ``params`` (in order), on the CPU.

    Each tensor is saved with the name of the device it came from, so that :func:`load_optimizer_state`
    puts it back where the optimizer keeps it (Adam's ``step`` counter stays on the CPU)."""
    if optimizer is None:
        return [{} for _ in params]
    saved = []
    for param in params:
        entry: dict[str, tuple[str, Any, str | None]] = {}
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, Tensor):
                entry[key] = ("tensor", value.detach().cpu().clone(), str(value.device))
            else:
                entry[key] = ("value", value, None)
        saved.append(entry)
    return saved


def load_optimizer_state(optimizer: Optimizer, params: Sequence[Tensor], saved: Sequence[dict[str, Any]]) -> None:
    """Replace the optimizer's state of each of ``params`` by what :func:`optimizer_state_of` saved."""
    for param, entry in zip(params, saved, strict=True):
        if not entry:
            optimizer.state.pop(param, None)
            continue
        optimizer.state[param] = {
            key: value.to(torch.device(device)) if kind == "tensor" else value
            for key, (kind, value, device) in entry.items()
        }


class ReplicaState:
    """Every rank's weights and inner-optimizer state, gathered into and restored from a checkpoint.

    Args:
        transport: the rule's transport (``gather`` is collective over it).
        params: the rule's trainable parameters, in model order.
    """

    def __init__(self, transport: Transport, params: Sequence[Tensor]) -> None:
        self.transport = transport
        self.params = list(params)
        self.optimizer: Optimizer | None = None  # the inner optimizer, as last seen
        self._pending: list[dict[str, Any]] | None = None

    def remember(self, optimizer: Optimizer) -> None:
        """Note the inner optimizer (the strategy hands it to the rule at every step)."""
        self.optimizer = optimizer

    def gather(self) -> list[dict[str, Any]]:
        """Every rank's ``{"weights": [...], "optimizer": [...]}`` in rank order (collective).

        A restored optimizer state that no step has applied yet is the rank's current one."""
        weights = [p.detach().cpu().clone() for p in self.params]
        inner = self._pending if self._pending is not None else optimizer_state_of(self.optimizer, self.params)
        mine = {"weights": weights, "optimizer": inner}
        if self.transport.size == 1:
            return [mine]
        return self.transport.allgather_object(mine)

    def restore(self, ranks: Sequence[dict[str, Any]], saved_world_size: int) -> bool:
        """Put this rank's saved weights into the parameters and keep its optimizer state for
        :meth:`apply_pending`. Returns ``False`` (and warns) when the checkpoint was written at
        another world size: then the caller decides where each rank starts."""
        if saved_world_size != self.transport.size or len(ranks) != self.transport.size:
            warnings.warn(
                f"lightning_mpi: the checkpoint holds the local state of {saved_world_size} ranks, this run has "
                f"{self.transport.size}; every rank starts from the global weights and rank 0's optimizer state.",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        mine = ranks[self.transport.rank]
        with torch.no_grad():
            for param, saved in zip(self.params, mine["weights"], strict=True):
                if tuple(saved.shape) != tuple(param.shape):
                    raise ValueError(
                        f"lightning_mpi: checkpoint weights of shape {tuple(saved.shape)} do not fit a parameter of "
                        f"shape {tuple(param.shape)}; resume with the model the checkpoint was written for"
                    )
                param.copy_(saved)
        self._pending = list(mine["optimizer"])
        return True

    def apply_pending(self, optimizer: Optimizer) -> None:
        """Load this rank's restored optimizer state (once, before the first update after a restore)."""
        self.remember(optimizer)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            load_optimizer_state(optimizer, self.params, pending)
