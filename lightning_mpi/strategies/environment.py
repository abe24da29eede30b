"""Ranks, nodes and local ranks from MPI, for Lightning.

Reuses Lightning's ``MPIEnvironment`` (hostname split into nodes) and resolves the node split
eagerly: it is a collective, so it must run at the same moment on every rank, which construction
of the strategy guarantees and lazy first use does not. Plain ``python train.py`` runs as an MPI
singleton of world size 1.

:class:`MPIClusterMixin` holds the behaviour; :mod:`lightning_mpi.strategies.build` puts it on the
``MPIEnvironment`` of each Fabric package (``lightning_fabric``, ``lightning.fabric``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def rank_device(devices: Sequence[torch.device] | None, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its host: ``devices[local_rank % len(devices)]``,
    or the CPU when the accelerator gave no devices."""
    return devices[local_rank % len(devices)] if devices else torch.device("cpu")


class MPIClusterMixin:
    """Lightning cluster environment backed by ``MPI.COMM_WORLD`` (mixed into ``MPIEnvironment``).

    Also exposes ``comm`` (a private duplicate of ``COMM_WORLD`` so that our traffic never
    matches a user's own MPI messages), ``local_comm`` (ranks on this host) and ``num_nodes``.
    """

    _comm_world: Any
    _comm_local: Any
    _node_rank: int

    def __init__(self) -> None:
        super().__init__()
        from mpi4py import MPI

        self.comm: Any = self._comm_world.Dup()
        self._init_comm_local()  # type: ignore[attr-defined]  # MPIEnvironment's, the base this is put on
        assert self._comm_local is not None
        self.local_comm: Any = self._comm_local
        self.num_nodes: int = self.comm.allreduce(self._node_rank, op=MPI.MAX) + 1

    @staticmethod
    def detect() -> bool:
        # Usable wherever mpi4py imports: world size 1 is a valid MPI job.
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            return False
        return True

    def teardown(self) -> None:
        # The communicators live as long as the strategy: a Trainer runs fit, then test, on one strategy.
        pass
