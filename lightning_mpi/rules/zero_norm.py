"""ZeRO's gradient norm over every rank's shard: the step-skip test and global-norm clipping.

After the reduce-scatter each rank holds the averaged gradients of its own chunks only (each
:class:`~lightning_mpi.rules.zero_bucket.ShardBucket`'s ``grad``), so a norm over the whole model
is a sum (or a max) over this rank's buckets and then one 8-byte Allreduce over the ranks
(:meth:`ShardGradNorm.global_sum`). The contract:

- :meth:`ShardGradNorm.agree`, once per step after the reduce-scatter, on every rank: the global
  sum of squares (non-finite: the step is skipped everywhere), remembered with the gradients'
  versions;
- :meth:`ShardGradNorm.clip_`, between ``before_step`` and ``optimizer.step()`` on every rank:
  torch's ``clip_grad_norm_`` over the whole model. The 2-norm reuses :meth:`agree`'s sum while the
  gradients are unchanged (no collective); any other norm, or changed gradients, is a collective.
  Norms are taken per bucket in the gradients' dtype and summed in float64 (no float64 copy of
  the shard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.zero_bucket import ShardBucket


class ShardGradNorm:
    """The global gradient norm of one ZeRO binding's buckets (see the module docstring)."""

    def __init__(self, transport: Transport, buckets: Sequence[ShardBucket]) -> None:
        self._transport = transport
        self._buckets = buckets
        self._norm_sq: tuple[float, tuple[int, ...]] | None = None  # global sum of squares, grad versions

    def agree(self) -> float:
        """The global sum of squares of the averaged gradients (a collective), kept for :meth:`clip_`."""
        total = self.global_sum(lambda g: torch.linalg.vector_norm(g).double().square(), "sum")
        self._norm_sq = (total, self._grad_versions())
        return total

    def clip_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> tuple[float, Tensor]:
        """Scale every bucket's gradient as ``torch.nn.utils.clip_grad_norm_`` would the whole
        model's. Returns the coefficient applied and the total norm (as torch returns it)."""
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"norm_type={norm_type!r} must be > 0 (or inf)")
        if norm_type == 2.0 and self._norm_sq is not None and self._norm_sq[1] == self._grad_versions():
            total = math.sqrt(self._norm_sq[0]) if self._norm_sq[0] >= 0 else float("nan")
        elif math.isinf(norm_type):
            total = self.global_sum(lambda g: g.abs().max() if g.numel() else g.new_zeros(()), "max")
        else:
            total = self.global_sum(lambda g: torch.linalg.vector_norm(g, norm_type).double() ** norm_type, "sum")
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from the sharded optimizer is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        coefficient = min(max_norm / (total + 1e-6), 1.0) if math.isfinite(total) else max_norm / (total + 1e-6)
        for bucket in self._buckets:
            bucket.grad.mul_(coefficient)
        return coefficient, torch.tensor(total, dtype=torch.float32)

    def global_sum(self, local: Callable[[Tensor], Tensor], op: str) -> float:
        """``op`` ("sum" or "max") over ranks of ``local(grad)`` summed (or maxed) over this rank's buckets."""
        values = [local(b.grad) for b in self._buckets]
        acc = torch.zeros((), dtype=torch.float64)
        for v in values:
            v = v.to("cpu", torch.float64)
            acc = acc + v if op == "sum" else torch.maximum(acc, v)
        flag = acc.reshape(1).clone()
        if self._transport.size > 1:
            self._transport.allreduce_(flag, op)
        return float(flag.item())

    def _grad_versions(self) -> tuple[int, ...]:
        return tuple(b.grad._version for b in self._buckets)
