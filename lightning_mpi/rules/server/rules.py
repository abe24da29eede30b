"""Parameter-server rules: DOWNPOUR, AGN, DynSGD, ADAG, AEASGD and EAMSGD.

Every rank trains and every rank hosts 1/W of the center θ̃ (the shared worker:
:mod:`lightning_mpi.rules.server.base`). Every ``period`` local steps a worker commits to θ̃ and
pulls it back; what it commits is its rule's formula (:mod:`lightning_mpi.rules.server.commits`).
Each rule below is a class of hyperparameters and a small bound class whose :meth:`exchange`
applies that formula.

Learning rate: DOWNPOUR adds every worker's whole delta, so W workers move the center ~W× per
epoch on their own ("asynchrony begets momentum", Mitliagkas et al. 2016); do not scale its lr
with W (Goyal et al.'s rule is for averaged gradients). The same holds for EAMSGD, whose Nesterov
momentum δ = 0.9 already multiplies the step by 10. The other rules here take the linear-scaled lr.

Defaults, cited: dist-keras' trainers use ``communication_window=5`` for DOWNPOUR and ADAG and 32
for AEASGD/EAMSGD (with ρ=5, η=0.1, i.e. α = 0.5, and momentum 0.9); Zhang et al. use α = 0.9/W. We
keep period 5 for DOWNPOUR/ADAG/DynSGD, 3 for AGN (measured, see :class:`AGNRule`), α = 0.9/W, δ =
0.9, and use period 8 instead of 32 for the elastic rules, because small jobs (a few hundred steps
per epoch) would otherwise exchange only a handful of times per epoch. ``eta`` for ADAG is not given
numerically in the sources we could check. We measured it (``tests/scripts/rules_train.py``: digits
MLP, 8 epochs, linear-scaled lr 0.1·W): at W = 3, η = 1 → 0.838, η = 0.1 → 0.947, η = 0.01 → 0.896
(one process 0.913), so the default is η = 0.1: η = 1 barely damps a stale commit, and a
DOWNPOUR-like sum of W deltas at lr 0.1·W overshoots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import number, option, options_class, with_default
from lightning_mpi.rules.base import all_finite
from lightning_mpi.rules.easgd import EASGDRule, default_alpha, nesterov_gradient_
from lightning_mpi.rules.server.base import BoundServerRule, ServerRule
from lightning_mpi.rules.server.commits import adag_commit, aeasgd_exchange, agn_commit, downpour_commit, dynsgd_commit


# -- the delta-committing rules: commit f(Δ), then pull ----------------------------------------------
class BoundDeltaRule(BoundServerRule):
    """Commits ``update(Δ, staleness)`` with one fetch-and-add, then pulls the center as it was
    just before this commit plus the commit (no second read)."""

    def update(self, delta: Tensor, stale: int) -> Tensor:
        """What this rule adds to the center for accumulated ``delta``."""
        raise NotImplementedError

    def exchange(self, theta: Tensor, stale: int) -> bool:
        update = self.update(theta - self.ref, stale)
        if not all_finite([update]):
            return False
        center, _ = self.windows()
        center.add(update, old=self.scratch)  # fetch-and-add: the center just before ours
        self.pull_(self.scratch + update)
        return True


@options_class
class DownpourRule(ServerRule):
    """DOWNPOUR (Dean et al. 2012) against a center sharded over all ranks: commit the accumulated
    change every ``period`` steps, then pull the center. Registered as ``mpi_downpour``."""

    name = "downpour"

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundDownpour:
        return BoundDownpour(self, transport, params)


class BoundDownpour(BoundDeltaRule):
    def update(self, delta: Tensor, stale: int) -> Tensor:
        return downpour_commit(delta)


@options_class
class AGNRule(ServerRule):
    """Accumulated Gradient Normalization (Hermans 2017): commit delta / ``period`` every ``period``
    steps, then pull. Registered as ``mpi_agn``.

    The normalisation makes one commit worth one step of a λ× larger batch, so the center moves
    ``period``× less per sample than DOWNPOUR's; a short window keeps that loss small (digits,
    W = 3, lr 0.1·W: period 5 → 0.889, 3 → 0.933, 2 → 0.936; one process 0.913).
    """

    name = "agn"

    period: int = with_default(ServerRule, "period", default=3)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundAGN:
        return BoundAGN(self, transport, params)


class BoundAGN(BoundDeltaRule):
    def update(self, delta: Tensor, stale: int) -> Tensor:
        return agn_commit(delta, self.rule.period)


@options_class
class DynSGDRule(ServerRule):
    """DynSGD (Jiang et al. 2017): commit delta / (staleness + 1) every ``period`` steps, then pull.
    Registered as ``mpi_dynsgd``."""

    name = "dynsgd"

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundDynSGD:
        return BoundDynSGD(self, transport, params)


class BoundDynSGD(BoundDeltaRule):
    def update(self, delta: Tensor, stale: int) -> Tensor:
        return dynsgd_commit(delta, stale)


@options_class
class ADAGRule(ServerRule):
    """ADAG (Hermans 2017): commit delta / (‖θ̃ − θ̃_pulled‖²/η + 1) every ``period`` steps, then pull;
    the norm is global. Registered as ``mpi_adag``.
    """

    name = "adag"

    eta: float = option(
        default=0.1,
        doc="η > 0, the squared center movement since the pull at which a commit is halved (measured on digits).",
        check=number(0.0, math.inf, low_open=True, high_open=True),
    )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundADAG:
        return BoundADAG(self, transport, params)


class BoundADAG(BoundServerRule):
    """Reads the center first (the scale depends on how far it moved), then commits."""

    rule: ADAGRule

    def exchange(self, theta: Tensor, stale: int) -> bool:
        center, _ = self.windows()
        center_now = center.read(self.scratch)
        update = adag_commit(theta - self.ref, center_now, self.ref, self.rule.eta)
        if not all_finite([update]):
            return False
        center.add(update)
        self.pull_(center_now + update)
        return True


# -- the elastic rules: exchange E = α(θ − θ̃) -------------------------------------------------------
@options_class
class AEASGDRule(ServerRule):
    """Asynchronous EASGD (Zhang et al. 2015): elastic exchange with the center, sharded over all
    ranks, every ``period`` steps. Registered as ``mpi_aeasgd``.
    """

    name = "aeasgd"

    period: int = with_default(ServerRule, "period", default=8)
    alpha: float | None = with_default(EASGDRule, "alpha", default=None)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundAEASGD:
        return BoundAEASGD(self, transport, params)


class BoundAEASGD(BoundServerRule):
    """Pulls θ̃, then moves the worker and the center towards each other by E."""

    starts_from_center = False

    def __init__(self, rule: AEASGDRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(rule, transport, params)
        self.alpha = default_alpha(rule.alpha, transport.size)

    def exchange(self, theta: Tensor, stale: int) -> bool:
        center, _ = self.windows()
        center_now = center.read(self.scratch)
        new_theta, e = aeasgd_exchange(theta, center_now, self.alpha)
        if not all_finite([e]):  # finite θ and θ̃ can still overflow their difference
            return False
        center.add(e)
        self.flat.push(new_theta)
        self.ref.copy_(center_now).add_(e)
        return True


@options_class
class EAMSGDRule(AEASGDRule):
    """EAMSGD (Zhang et al. 2015): asynchronous EASGD plus Nesterov momentum on the worker's local
    steps. Use it with plain SGD (no optimizer momentum): the rule supplies the momentum.
    Registered as ``mpi_eamsgd``.
    """

    name = "eamsgd"

    momentum: float = option(
        default=0.9,
        doc="Nesterov momentum δ in [0, 1) (dist-keras; Zhang et al. use 0.99); with "
        "`implicit_momentum_correction=True` the rule runs with max(0, δ - (1 - 1/W)).",
        check=number(0.0, 1.0, high_open=True),
    )

    @property
    def own_momentum(self) -> float | None:
        return self.momentum

    def with_momentum(self, momentum: float) -> EAMSGDRule:
        return dataclasses.replace(self, momentum=momentum)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundEAMSGD:
        return BoundEAMSGD(self, transport, params)


class BoundEAMSGD(BoundAEASGD):
    """AEASGD with Nesterov momentum applied to the worker's gradients before each local step."""

    rule: EAMSGDRule

    def __init__(self, rule: EAMSGDRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(rule, transport, params)
        self.momentum_bufs = [torch.zeros_like(p) for p in self.params]

    def before_step(self, optimizer: Any) -> bool:
        """Reject this rank's step if its gradients are non-finite (they never reach the momentum
        or the weights; the step still counts towards the next commit); else Nesterov momentum."""
        if not super().before_step(optimizer):
            return False
        for p, buf in zip(self.params, self.momentum_bufs, strict=True):
            if p.grad is not None:
                nesterov_gradient_(p.grad, buf, self.rule.momentum)
        return True


__all__ = ["DownpourRule", "AGNRule", "DynSGDRule", "ADAGRule", "AEASGDRule", "EAMSGDRule"]
