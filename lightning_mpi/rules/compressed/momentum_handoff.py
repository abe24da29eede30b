"""Deep Gradient Compression's momentum correction beside an optimizer that has momentum of its own.

DGC (Lin et al. 2018) applies momentum on each rank before sparsification: ``u = m·u + g``,
``v = v + u``, and the top-k of ``v`` is exchanged, so the exchanged update ``S_t`` already
carries momentum, and the optimizer must not apply it again. Instead of asking users to switch
their optimizer's momentum off, :class:`MomentumHandoff` hands it

    x_t = (S_t − m·S_(t−1)) / (1 − dampening)

in place of ``S_t``. Heavy-ball SGD's buffer ``buf = m·buf + (1 − dampening)·x`` then equals ``S_t``
at every step (its first step takes ``x_0 = S_0`` whole), so the weights move by ``lr·S_t``: DGC's
update, with momentum applied once. At ``ratio=1`` without momentum masking ``S_t`` is the mean
velocity and ``x_t`` the mean gradient: exactly the optimizer on the mean gradient. Weight decay is
added by the optimizer after the hand-off and keeps its momentum, as on one process.

It keeps ``S_(t−1)`` per bucket (the same on every rank), one model-sized buffer, and costs three
passes over the gradients a step. Pure tensor code: no MPI, no Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.buffers import Bucket

#: Momentum correction's ``m`` when neither the rule nor the optimizer gives one (Lin et al. use 0.9).
DGC_MOMENTUM = 0.9


def compensate_(grad: Tensor, previous: Tensor, momentum: float, dampening: float, first: bool) -> None:
    """Turn the exchanged update ``S_t`` (in ``grad``) into ``(S_t − m·S_(t−1)) / (1 − dampening)``
    (no division on the optimizer's first step, which takes its input whole). ``previous`` holds
    ``S_(t−1)`` and is left holding ``S_t``; two passes, no scratch."""
    previous.mul_(momentum)
    grad.sub_(previous)  # S_t - m*S_(t-1)
    previous.add_(grad)  # S_t
    if dampening and not first:
        grad.div_(1.0 - dampening)


def optimizer_momentum(optimizer: Optimizer, params: Sequence[Tensor], given: float | None) -> float:
    """The ``m`` of momentum correction: ``given``, else the optimizer's ``momentum`` over the groups
    that hold ``params`` (one value, or ``ValueError``), else :data:`DGC_MOMENTUM`."""
    if given is not None:
        return given
    members = {id(p) for p in params}
    groups = [g for g in optimizer.param_groups if any(id(p) in members for p in g["params"])]
    found = sorted({float(g.get("momentum", 0.0) or 0.0) for g in groups})
    if len(found) > 1:
        raise ValueError(
            f"momentum=None takes the optimizer's momentum, but its parameter groups have {found}: "
            "pass momentum=<one value> to the strategy"
        )
    return found[0] if found and found[0] else DGC_MOMENTUM


class MomentumHandoff:
    """``S_(t−1)`` per bucket and the hand-off of each step's update to an optimizer with momentum."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = list(buckets)
        #: per bucket: the last exchanged update; empty until an optimizer with momentum is seen
        self.previous: list[Tensor] = []
        self._views: dict[int, Tensor] = {}  # id(param) -> its view into previous
        self.steps = 0

    def watch(self, optimizer: Optimizer) -> None:
        """Allocate ``S_(t−1)`` once an optimizer with momentum is seen (nothing to hand off otherwise)."""
        if not self.previous and any(g.get("momentum", 0.0) for g in optimizer.param_groups):
            self.previous = [torch.zeros_like(b.flat) for b in self.buckets]
            self._map()

    @property
    def active(self) -> bool:
        return bool(self.previous)

    def _map(self) -> None:
        self._views = {
            id(t): prev[o : o + t.numel()].view_as(t)
            for bucket, prev in zip(self.buckets, self.previous, strict=True)
            for t, o in zip(bucket.tensors, bucket.offsets, strict=True)
        }

    def hand_off(self, optimizer: Optimizer) -> None:
        """:func:`compensate_` the ``.grad`` of every parameter in a group with momentum."""
        first = self.steps == 0
        for group in optimizer.param_groups:
            m = float(group.get("momentum", 0.0) or 0.0)
            if not m:
                continue
            dampening = float(group.get("dampening", 0.0) or 0.0)
            for p in group["params"]:
                prev = self._views.get(id(p))
                if prev is not None and p.grad is not None:
                    compensate_(p.grad, prev, m, dampening, first)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        if not self.previous:
            return {}
        return {"previous": [t.detach().cpu().clone() for t in self.previous], "compensated_steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``S_(t−1)``; members sit at the same offsets at any world size, only the padding differs."""
        previous = state.get("previous")
        if not previous or len(previous) != len(self.buckets):
            return
        self.previous = [torch.zeros_like(b.flat) for b in self.buckets]
        for dst, src, bucket in zip(self.previous, previous, self.buckets, strict=True):
            dst[: bucket.numel].copy_(src[: bucket.numel])
        self._map()
        self.steps = int(state.get("compensated_steps", 1))


__all__ = ["DGC_MOMENTUM", "MomentumHandoff", "compensate_", "optimizer_momentum"]
