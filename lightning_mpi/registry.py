"""One table of strategy names; :func:`register_strategies` puts them in Lightning's registry."""
from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import StrategyRegistry

from lightning_mpi.async_strategies import (
    ADAGStrategy,
    AEASGDStrategy,
    AGNStrategy,
    DownpourStrategy,
    DynSGDStrategy,
    EAMSGDStrategy,
    EASGDStrategy,
    GoSGDStrategy,
    ModelAveragingStrategy,
)
from lightning_mpi.compressed_strategies import CompressedSyncStrategy
from lightning_mpi.strategy import SyncStrategy

#: name -> (strategy class, init params, description)
STRATEGIES: dict[str, tuple[type, dict[str, Any], str]] = {
    "mpi_allreduce": (SyncStrategy, {"exchange": "allreduce"}, "Synchronous: average gradients with MPI_Allreduce"),
    "mpi_asa": (SyncStrategy, {"exchange": "asa"}, "Synchronous: Alltoall, fp32 sum, Allgather (Theano-MPI ASA)"),
    "mpi_asa16": (SyncStrategy, {"exchange": "asa", "wire": "fp16"}, "Synchronous ASA with fp16 on the wire, fp32 sums"),
    "mpi_asa_bf16": (SyncStrategy, {"exchange": "asa", "wire": "bf16"}, "Synchronous ASA with bf16 on the wire, fp32 sums"),
    "mpi_asa_int8": (CompressedSyncStrategy, {"codec": "int8"}, "Synchronous ASA with int8 min-max quantization, fp32 sums, error feedback"),
    "mpi_topk": (CompressedSyncStrategy, {"codec": "topk"}, "Synchronous top-k sparsified exchange of (index, value) pairs, error feedback"),
    "mpi_onebit": (CompressedSyncStrategy, {"codec": "onebit"}, "Synchronous ASA with 1-bit signs and per-chunk scales, error feedback"),
    "mpi_easgd": (EASGDStrategy, {}, "Synchronous elastic averaging (Zhang et al. 2015), center kept by allreduce"),
    "mpi_model_avg": (ModelAveragingStrategy, {}, "Periodic model averaging (local SGD)"),
    "mpi_aeasgd": (AEASGDStrategy, {}, "Asynchronous EASGD against a center sharded over all ranks"),
    "mpi_eamsgd": (EAMSGDStrategy, {}, "Asynchronous EASGD with Nesterov momentum, sharded center"),
    "mpi_downpour": (DownpourStrategy, {}, "DOWNPOUR: commit accumulated delta, pull the sharded center"),
    "mpi_agn": (AGNStrategy, {}, "Accumulated gradient normalization: commit delta / period"),
    "mpi_adag": (ADAGStrategy, {}, "ADAG: commit scaled by 1/(|center moved|^2/eta + 1)"),
    "mpi_dynsgd": (DynSGDStrategy, {}, "DynSGD: commit divided by staleness + 1"),
    "mpi_gosgd": (GoSGDStrategy, {}, "GoSGD gossip: push to a random peer with probability p, weighted merge"),
}


def register_strategies() -> None:
    """Register every name in :data:`STRATEGIES` (idempotent: re-import overrides itself)."""
    for name, (cls, params, description) in STRATEGIES.items():
        StrategyRegistry.register(name, cls, description=description, override=True, **params)
