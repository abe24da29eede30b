"""One table of strategy names; :func:`register_strategies` puts them in Lightning's registry."""
from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import StrategyRegistry

from lightning_mpi.strategy import SyncStrategy

#: name -> (strategy class, init params, description)
STRATEGIES: dict[str, tuple[type, dict[str, Any], str]] = {
    "mpi_allreduce": (SyncStrategy, {"exchange": "allreduce"}, "Synchronous: average gradients with MPI_Allreduce"),
    "mpi_asa": (SyncStrategy, {"exchange": "asa"}, "Synchronous: Alltoall, fp32 sum, Allgather (Theano-MPI ASA)"),
    "mpi_asa16": (SyncStrategy, {"exchange": "asa", "wire": "fp16"}, "Synchronous ASA with fp16 on the wire, fp32 sums"),
    "mpi_asa_bf16": (SyncStrategy, {"exchange": "asa", "wire": "bf16"}, "Synchronous ASA with bf16 on the wire, fp32 sums"),
}


def register_strategies() -> None:
    """Register every name in :data:`STRATEGIES` (idempotent: re-import overrides itself)."""
    for name, (cls, params, description) in STRATEGIES.items():
        StrategyRegistry.register(name, cls, description=description, override=True, **params)
