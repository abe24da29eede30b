"""ZeRO inside the replicas (``inner_exchange="zero"``): the optimizer shards the strategy sees.

Each replica shards its own optimizer over its ranks, as ``mpi_zero`` shards one over the run
(:mod:`lightning_mpi.rules.zero`); the replicas step apart between their outer exchanges, so a run
of R replicas holds R copies of the optimizer state, each sharded. The strategy handles them as it
handles ``mpi_zero``'s (:class:`~lightning_mpi.rules.base.OptimizerShards`): every rank writes its
shard into a sharded checkpoint, and each shard says which copy it belongs to, its replica
(:func:`~lightning_mpi.rules.zero.state.copies`). A load takes this rank's replica's shards where
the save holds as many replicas as the run (the same rule as the replicas' weights,
:meth:`~lightning_mpi.rules.hybrid.rule.BoundHybrid.load_state_dict`), else replica 0's, which holds
the run's rank 0: resharded over the replica's ranks in both cases, at any replica size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_mpi.rules.base import BoundRule, OptimizerShards
from lightning_mpi.rules.hybrid.layout import Layout
from lightning_mpi.rules.zero.state import copies


class ReplicaShards:
    """The :class:`~lightning_mpi.rules.base.OptimizerShards` of a two-level run: the inner ZeRO
    binding's (``inner``, over the replica's communicator), with each shard tagged by its replica."""

    def __init__(self, inner: OptimizerShards, layout: Layout) -> None:
        self.inner = inner
        self.layout = layout

    @property
    def optimizer(self) -> Optimizer | None:
        return self.inner.optimizer

    @property
    def same_weights(self) -> bool:
        """One replica: its members' weights are the same; several step apart between their exchanges."""
        return self.layout.replicas == 1

    def take_optimizer(self, optimizer: Optimizer, previous: BoundRule | None) -> bool:
        # no binding before this one to rebuild from: mpi_hybrid does not heal with ZeRO inside
        # (BoundHybrid.healing refuses it)
        return self.inner.take_optimizer(optimizer, None)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip by the norm of the replica's averaged gradients (collective over the replica): the
        replica is one process with the batch of its ranks."""
        return self.inner.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def optimizer_state(self) -> dict[str, Any]:
        return {**self.inner.optimizer_state(), "copy": self.layout.replica}

    def load_optimizer_state(self, saved: Any) -> None:
        """Torch's format (a plain checkpoint: every replica takes it) or one shard as they are; the
        shards of a sharded save: this replica's, or replica 0's (module docstring)."""
        if isinstance(saved, Mapping):
            self.inner.load_optimizer_state(saved)
            return
        replicas = copies(list(saved))
        same = len(replicas) == self.layout.replicas
        self.inner.load_optimizer_state(replicas[self.layout.replica] if same else replicas[0])
