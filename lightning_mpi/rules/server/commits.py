"""What a parameter-server worker commits to the center θ̃: one pure function per rule.

Every ``period`` local steps a worker with weights θ, reference θ_ref (its θ at its last pull)
and Δ = θ − θ_ref commits, then pulls (θ ← θ̃):

- DOWNPOUR (Dean et al., "Large scale distributed deep networks", NIPS 2012)::

      θ̃ ← θ̃ + Δ

- AGN, accumulated gradient normalization (Hermans, "On the convergence of asynchronous
  optimization", MSc thesis, Liège 2017; dist-keras)::

      θ̃ ← θ̃ + Δ / period

- DynSGD (Jiang et al., "Heterogeneity-aware distributed parameter servers", SIGMOD 2017;
  dist-keras), with s the commits by others since this worker's last pull::

      θ̃ ← θ̃ + Δ / (s + 1)

- ADAG (Hermans 2017, dist-keras), with θ̃_pulled the center this worker last pulled::

      θ̃ ← θ̃ + Δ / (‖θ̃ − θ̃_pulled‖² / η + 1)

  The norm is **global** (over the whole flattened model), not element-wise: it measures how far
  the center moved since this worker pulled, i.e. how stale the worker's Δ is, and a global scalar
  keeps Δ's direction. An element-wise version would rescale each coordinate differently and turn
  the commit into a different direction (an Adagrad-like preconditioner, a different method).

The elastic rules (Zhang et al. 2015) exchange instead of committing a delta: AEASGD (Alg. 1)
pulls θ̃, then with E = α(θ − θ̃) does θ ← θ − E and θ̃ ← θ̃ + E (:func:`aeasgd_exchange`);
EAMSGD (Alg. 2) is AEASGD plus Nesterov momentum on the worker's local steps
(:func:`~lightning_mpi.rules.easgd.nesterov_gradient_`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_mpi.rules.easgd import elastic_difference


def staleness(clock_before_commit: int, clock_at_pull: int) -> int:
    """Commits by others between this worker's last pull and this commit."""
    return clock_before_commit - clock_at_pull


def downpour_commit(delta: Tensor) -> Tensor:
    """DOWNPOUR: ``Δ``, the accumulated delta unchanged."""
    return delta


def agn_commit(delta: Tensor, period: int) -> Tensor:
    """AGN: ``Δ / period``, the accumulated delta divided by the number of local steps."""
    return delta / period


def dynsgd_scale(stale: int) -> float:
    """DynSGD's server factor ``1 / (staleness + 1)``."""
    return 1.0 / (stale + 1.0)


def dynsgd_commit(delta: Tensor, stale: int) -> Tensor:
    """DynSGD: ``Δ / (staleness + 1)``."""
    return delta * dynsgd_scale(stale)


def adag_scale(center_now: Tensor, center_pulled: Tensor, eta: float) -> float:
    """ADAG's server factor ``1 / (‖θ̃ − θ̃_pulled‖² / η + 1)`` with the global (whole-model) L2 norm."""
    moved = float(torch.sum((center_now.double() - center_pulled.double()) ** 2))
    return 1.0 / (moved / eta + 1.0)


def adag_commit(delta: Tensor, center_now: Tensor, center_pulled: Tensor, eta: float) -> Tensor:
    """ADAG: ``Δ / (‖θ̃ − θ̃_pulled‖² / η + 1)``."""
    return delta * adag_scale(center_now, center_pulled, eta)


def aeasgd_exchange(theta: Tensor, center_now: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    """AEASGD: ``E = α(θ − θ̃)``; returns ``(θ − E, E)``, the worker's new weights and what the center gains."""
    e = elastic_difference(theta, center_now, alpha)
    return theta - e, e
