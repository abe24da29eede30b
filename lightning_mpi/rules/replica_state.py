"""Every rank's own training state in a checkpoint, for rules whose ranks differ between exchanges.

Between two exchanges of a local-step rule (DiLoCo, Streaming DiLoCo) each rank holds its own
weights and its own inner-optimizer state (SGD momentum, Adam moments). A Lightning checkpoint
holds rank 0's copy of both, so a run resumed mid-period would restart every rank from rank 0's
weights and moments, and would not retrace the uninterrupted run. :class:`ReplicaState`
carries every rank's copy instead:

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
