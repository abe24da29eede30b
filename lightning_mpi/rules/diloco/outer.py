"""DiLoCo's math as pure functions (:mod:`lightning_mpi.rules.diloco.rule` has the algorithm and the rule):
the pseudo-gradient, the outer step, the mixing of Streaming DiLoCo, the fragments' schedule and
the outer learning rate's warm-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_mpi.rules.easgd import FlatParams


def pseudo_gradient(theta_global: Tensor, theta_local: Tensor) -> Tensor:
    """Δᵢ = θ_global − θᵢ: how far this rank's inner steps moved it (the outer optimizer's gradient)."""
    return theta_global - theta_local


def make_outer_optimizer(globals_: Sequence[Tensor], outer_lr: float, outer_momentum: float) -> torch.optim.SGD:
    """The outer optimizer over the global weights: SGD, with Nesterov momentum when momentum > 0.

    Fused where torch has the kernel (CPU and CUDA): one pass and no temporary, where the
    single-tensor loop allocates Δ + μb anew each step (6.0 ms against 2.0 ms for 4M fp32 values
    on one CPU core), with the same results."""
    globals_ = list(globals_)
    fused = bool(globals_) and all(t.device.type in ("cpu", "cuda") for t in globals_)
    return torch.optim.SGD(
        globals_, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0, fused=fused or None
    )


def outer_step_(optimizer: torch.optim.SGD, theta_global: Tensor, mean_delta: Tensor) -> Tensor:
    """One outer step on ``theta_global`` (one of ``optimizer``'s tensors) with gradient ``mean_delta``.

    Only this tensor moves: the optimizer's other tensors have no gradient and SGD skips them.
    With Nesterov momentum μ and rate η: ``b ← μ b + Δ``, ``θ ← θ − η (Δ + μ b)``."""
    theta_global.grad = mean_delta
    optimizer.step()
    theta_global.grad = None
    return theta_global


def mix_(theta_local: Tensor, theta_global: Tensor, alpha: float) -> Tensor:
    """θ_local ← α·θ_local + (1 − α)·θ_global in place (α = 0 copies θ_global exactly)."""
    if alpha == 0.0:
        return theta_local.copy_(theta_global)
    return theta_local.mul_(alpha).add_(theta_global, alpha=1.0 - alpha)


def apply_mean_delta_(
    optimizer: torch.optim.SGD, theta_global: Tensor, mean_delta: Tensor, average: bool, local: FlatParams, alpha: float
) -> None:
    """A fragment's exchange arrived: θ_global moves by the replicas' mean Δ (``average``: θ_global ←
    θ_global − Δ, the replicas' mean, no momentum; else one outer step), then the arriving
    fragment is mixed into the ``local`` weights (``alpha`` 1: they stay)."""
    if average:
        theta_global.sub_(mean_delta)
    else:
        outer_step_(optimizer, theta_global, mean_delta)
    if alpha < 1.0:
        weights = local.pull()
        mix_(weights, theta_global, alpha)
        local.push()


def starts_at(step: int, offset: int, period: int) -> bool:
    """Whether a fragment with this ``offset`` starts an exchange after update ``step`` (1-based)."""
    return step >= offset and (step - offset) % period == 0


def last_start(step: int, offset: int, period: int) -> int:
    """The last step ≤ ``step`` at which that fragment started an exchange (0: none yet)."""
    return 0 if step < offset else offset + (step - offset) // period * period


def averages_at(outer_step: int, warmup: int) -> bool:
    """Whether a fragment's ``outer_step``-th outer step (1-based) is one of its first ``warmup``,
    which average the replicas (θ_global ← θ_global − Δ = the mean θᵢ) instead of taking a
    Nesterov step."""
    return outer_step <= warmup
