"""Ranks, nodes and local ranks from MPI, for Lightning.

Reuses Lightning's ``MPIEnvironment`` (hostname split into nodes) and resolves the node split
eagerly: it is a collective, so it must run at the same moment on every rank, which construction
of the strategy guarantees and lazy first use does not. Plain ``python train.py`` runs as an MPI
singleton of world size 1.

:class:`MPIClusterMixin` holds the behaviour; :mod:`lightning_mpi.strategies.build` puts it on the
``MPIEnvironment`` of each Fabric package (``lightning_fabric``, ``lightning.fabric``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_mpi.comm import spares


def rank_device(devices: Sequence[torch.device] | None, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its host: ``devices[local_rank % len(devices)]``,
    or the CPU when the accelerator gave no devices."""
    return devices[local_rank % len(devices)] if devices else torch.device("cpu")


def device_local_rank(environment: Any, local_rank: int) -> int:
    """The local rank that picks this process's device: ``local_rank``, or after a heal the one it
    had before (:attr:`MPIClusterMixin.device_local_rank`), so that the model stays where it is."""
    kept = getattr(environment, "device_local_rank", None)
    return local_rank if kept is None else int(kept)


#: After a heal, the survivors' communicator stands for ``COMM_WORLD`` in this process: a strategy
#: built later (a new Trainer or Fabric) spans the survivors, not the ranks that died. With spares
#: (``lightning-mpi --spares K``) it is from the start the training ranks' part of ``COMM_WORLD``
#: (a spare's: the spares') (:mod:`lightning_mpi.comm.spares`).
_WORLD: list[Any] = []


class MPIClusterMixin:
    """Lightning cluster environment backed by ``MPI.COMM_WORLD`` (mixed into ``MPIEnvironment``).

    Also exposes ``comm`` (a private duplicate of ``COMM_WORLD`` so that our traffic never
    matches a user's own MPI messages), ``local_comm`` (ranks on this host) and ``num_nodes``.
    """

    # MPIEnvironment's, the base this is put on (declared for the type checker only)
    _comm_world: Any
    _comm_local: Any
    _node_rank: int
    _init_comm_local: Callable[[], None]
    local_rank: Callable[[], int]
    #: after a heal, the local rank this process had when it chose its device (local ranks may
    #: change, the device does not); ``None`` before any heal
    device_local_rank: int | None = None

    def __init__(self) -> None:
        super().__init__()
        spares.strategy_built()
        if not _WORLD and spares.requested():  # the first strategy of the process: the spares step aside
            _WORLD[:] = [spares.split_off_spares(self._comm_world, spares.requested())]
        if _WORLD:
            self._comm_world = _WORLD[0]
        self.comm: Any = self._comm_world.Dup()
        self.local_comm: Any = None
        self.num_nodes: int = 0
        self._read_layout()

    def _read_layout(self) -> None:
        """Split the node communicator off ``comm`` and count the nodes (collective over ``comm``)."""
        from mpi4py import MPI

        self._init_comm_local()
        assert self._comm_local is not None
        self.local_comm = self._comm_local
        self.num_nodes = self.comm.allreduce(self._node_rank, op=MPI.MAX) + 1

    def derived_comms(self) -> list[Any]:
        """The communicators made here besides ``comm`` (revoked by a heal)."""
        return [self._comm_local]

    def adopt(self, comm: Any) -> None:
        """After a heal: ``comm`` (the survivors' communicator) replaces ``COMM_WORLD`` and ``comm``
        here; ranks, world size, local ranks and the node count are read again from it, and the
        node communicator is split again (collective over ``comm``)."""
        from lightning_mpi.comm.ulfm import free

        old_local = self._comm_local
        if self.device_local_rank is None:  # this process keeps its device: the model lives there
            self.device_local_rank = self.local_rank()
        self._comm_world = self.comm = comm
        _WORLD[:] = [comm]
        spares.training_world(comm)
        self._comm_local = None
        for name in ("world_size", "global_rank", "local_rank"):  # Lightning caches them (lru_cache)
            clear = getattr(getattr(type(self), name, None), "cache_clear", None)
            if clear is not None:
                clear()
        self._read_layout()
        free(old_local)

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
