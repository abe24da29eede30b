"""Elastic averaging (Zhang, Choromanska & LeCun, "Deep learning with Elastic Averaging SGD",
NIPS 2015, arXiv:1412.6651): the math as pure functions, and synchronous EASGD as a rule.

Each worker i keeps its own weights θᵢ and is pulled towards a center θ̃ by an elastic force
of strength α = ηρ. Every ``period`` (τ) local steps:

    θᵢ ← θᵢ − α (θᵢ − θ̃)                 (worker, elastic step)
    θ̃  ← θ̃ + α Σᵢ (θᵢ − θ̃)              (center, synchronous: one allreduce of θᵢ − θ̃)

Both use the *old* θᵢ − θ̃, so worker and center move symmetrically (Zhang et al., Eq. 5–6).
The asynchronous variants (AEASGD, EAMSGD) use :func:`elastic_difference` against a parameter
server (see :mod:`lightning_mpi.rules.server.rules`); EAMSGD adds Nesterov momentum δ on the worker
(:func:`nesterov_gradient_`, Zhang et al. Algorithm 2).

Defaults, cited: Zhang et al. §5 set β = pα = 0.9, i.e. α = 0.9 / W (``alpha=None`` means
that), and run τ ∈ {1, 4, 16, 64}; we take τ = 4, the shortest that still cuts traffic 4×.
Their EAMSGD runs use momentum δ = 0.99; dist-keras (Hermans) defaults to 0.9, which we take
because it is stable with the plain-SGD learning rates users already have.

Healing (synchronous EASGD): a survivor keeps its step count and the center (the checkpoint state;
replicated: every survivor holds it whole); the weights are the module's. The elastic exchange
(``after_step``) is redone with the state before it (the weights change only once it completed),
or its weights and center taken from a survivor that completed it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, optional, options_class
from lightning_mpi.rules.base import BoundLocalStepRule, Execute, Rule, redone_from_state

#: The check of every elastic rule's ``alpha``: None, or a number in (0, 1].
ALPHA = optional(number(0.0, 1.0, low_open=True))


# -- pure math ------------------------------------------------------------------------------------
def elastic_difference(theta: Tensor, center: Tensor, alpha: float) -> Tensor:
    """``α (θ − θ̃)``: what the worker subtracts from θ and what the center gains from it."""
    return alpha * (theta - center)


def easgd_sync_update(theta: Tensor, center: Tensor, sum_diff: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """One synchronous EASGD exchange for worker ``theta``.

    ``sum_diff`` is Σᵢ(θᵢ − θ̃) over all workers (the allreduce). Returns ``(θ − α(θ − θ̃),
    θ̃ + α·sum_diff)``.
    """
    return theta - alpha * (theta - center), center + alpha * sum_diff


def nesterov_gradient_(grad: Tensor, buf: Tensor, delta: float) -> Tensor:
    """Nesterov momentum in gradient form, in place: ``buf ← δ·buf + g``; ``g ← g + δ·buf``.

    Followed by plain SGD ``θ ← θ − η g`` this is ``v ← δv − ηg; θ ← θ + δv − ηg``, the
    look-ahead update of EAMSGD (Zhang et al. Alg. 2, Sutskever et al. 2013 form). Returns ``grad``.
    """
    buf.mul_(delta).add_(grad)
    grad.add_(buf, alpha=delta)
    return grad


def default_alpha(alpha: float | None, world_size: int) -> float:
    """``alpha`` if given, else Zhang et al.'s β/p with β = 0.9."""
    return float(alpha) if alpha is not None else 0.9 / max(1, world_size)


class FlatParams:
    """All trainable parameters as one padded flat buffer (one dtype, one device)."""

    def __init__(self, params: Sequence[Tensor], world_size: int) -> None:
        buckets = make_buckets(params, world_size, bucket_bytes=None, reverse=False)
        if not buckets:
            raise ValueError(
                "lightning_mpi: no trainable parameters to exchange (every parameter has requires_grad=False); "
                "unfreeze at least one, or train without an MPI strategy"
            )
        if len(buckets) != 1:
            raise ValueError(
                "lightning_mpi: elastic, parameter-server and gossip rules need every trainable parameter "
                f"in one dtype on one device; got {len(buckets)} groups"
            )
        self.bucket = buckets[0]
        self.flat = self.bucket.flat
        self._host: Tensor | None = None  # pull_host()'s copy, made at its first call on a GPU

    def pull(self) -> Tensor:
        """Copy the parameters into :attr:`flat` and return it."""
        self.bucket.pack()
        return self.flat

    def pull_host(self) -> Tensor:
        """:meth:`pull`, as a tensor in host memory: :attr:`flat` itself on the CPU, else one
        reused (pinned) copy. The rules whose exchanges go through one-sided windows or a mailbox
        compute on it, since those hold host memory (the MPI need not be CUDA-aware);
        :meth:`push` copies back to the parameters' device."""
        flat = self.pull()
        if flat.device.type == "cpu":
            return flat
        if self._host is None:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return self._host.copy_(flat)

    def push(self, values: Tensor | None = None) -> None:
        """Copy ``values`` (default :attr:`flat`) into the parameters."""
        if values is not None and values is not self.flat:
            self.flat.copy_(values)
        self.bucket.unpack()


# -- synchronous EASGD ------------------------------------------------------------------------------
@options_class
class EASGDRule(Rule):
    """Synchronous EASGD (Zhang et al. 2015): elastic step and center update every ``period`` steps, one
    allreduce; the center is replicated on every rank. Registered as ``mpi_easgd``.
    """

    name = "easgd"

    period: int = option(
        default=4, doc="τ, local steps between elastic exchanges (≥ 1); Zhang et al. use 1 to 64.", check=integer(1)
    )
    alpha: float | None = option(
        default=None,
        doc="elastic moving rate α = ηρ in (0, 1]; None means 0.9 / W (Zhang et al.'s β = Wα = 0.9).",
        check=ALPHA,
    )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundEASGD:
        return BoundEASGD(self, transport, params)


class BoundEASGD(BoundLocalStepRule):
    def __init__(self, rule: EASGDRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params, rule.name)
        self.rule = rule
        self.alpha = default_alpha(rule.alpha, transport.size)
        self.flat = FlatParams(self.params, transport.size)
        self.center = self.flat.pull().clone()  # replicated: identical on every rank
        self.steps = 0
        self._loaded = False
        self._seconds = 0.0
        self._bytes = 0

    def on_train_start(self) -> None:
        if not self._loaded:
            self.center.copy_(self.flat.pull())

    def healable_after_step(self, optimizer: Any, execute: Execute) -> None:
        period = self.rule.period
        execute(
            redone_from_state(
                "the elastic exchange",
                lambda bound: bound.after_step(optimizer),
                moving=lambda bound: list(bound.params),
                exchanged=lambda bound, before: (
                    bound.transport.size > 1 and bound.steps != before["steps"] and bound.steps % period == 0
                ),
                restore=False,  # the weights change only once the exchange completed
            )
        )

    def _advance(self) -> None:
        """Count one local step; every ``period`` steps, the elastic exchange (collective)."""
        self.steps += 1
        self._seconds, self._bytes = 0.0, 0
        if self.steps % self.rule.period or self.transport.size == 1:
            return
        start = time.perf_counter()
        theta = self.flat.pull()
        diff = theta - self.center
        total = diff.clone()
        self.transport.allreduce_(total, "sum")
        new_theta, new_center = easgd_sync_update(theta, self.center, total, self.alpha)
        self.center.copy_(new_center)
        self.flat.push(new_theta)
        self._seconds = time.perf_counter() - start
        self._bytes = int(2 * (self.transport.size - 1) / self.transport.size * total.numel() * total.element_size())

    def on_train_end(self) -> None:
        if self.transport.size > 1:
            self.flat.push(self.center)

    def state_dict(self) -> dict[str, Any]:
        """The (replicated) center, unpadded so that any world size can load it, and the step count."""
        n = self.flat.bucket.numel
        return {"center": self.center[:n].clone(), "steps": self.steps, "world_size": self.transport.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = self.flat.bucket.numel
        self.center.zero_()
        self.center[:n].copy_(state["center"].reshape(-1)[:n])
        self.steps = int(state["steps"])
        self._loaded = True

    def stats(self) -> dict[str, float]:
        return {
            "exchange_seconds": self._seconds,
            "wire_bytes": float(self._bytes),
            "skipped_steps": float(self.guard.skipped_steps),
        }
