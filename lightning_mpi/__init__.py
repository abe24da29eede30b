"""lightning_mpi: PyTorch Lightning strategies for data-parallel training over MPI.

``import lightning_mpi`` registers every ``mpi_*`` strategy name with Lightning, so
``Trainer(strategy="mpi_asa16")`` works.
"""
from lightning_mpi.async_strategies import (
    ADAGStrategy,
    AEASGDStrategy,
    AGNStrategy,
    AsyncMPIStrategy,
    DownpourStrategy,
    DynSGDStrategy,
    EAMSGDStrategy,
    EASGDStrategy,
    GoSGDStrategy,
    ModelAveragingStrategy,
)
from lightning_mpi.compressed_strategies import CompressedSyncStrategy
from lightning_mpi.data import PrefetchDataModule
from lightning_mpi.offload import LMSOffload
from lightning_mpi.registry import STRATEGIES, register_strategies
from lightning_mpi.rules.averaging import ModelAveragingRule
from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.rules.easgd import EASGDRule
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule
from lightning_mpi.rules.sync import SyncRule
from lightning_mpi.strategy import MPIStrategy, SyncStrategy

__version__ = "0.1.0"

register_strategies()

__all__ = [
    "MPIStrategy",
    "SyncStrategy",
    "CompressedSyncStrategy",
    "CompressedSyncRule",
    "AsyncMPIStrategy",
    "EASGDStrategy",
    "ModelAveragingStrategy",
    "AEASGDStrategy",
    "EAMSGDStrategy",
    "DownpourStrategy",
    "AGNStrategy",
    "ADAGStrategy",
    "DynSGDStrategy",
    "GoSGDStrategy",
    "PrefetchDataModule",
    "LMSOffload",
    "Rule",
    "BoundRule",
    "SyncRule",
    "EASGDRule",
    "ModelAveragingRule",
    "GoSGDRule",
    "DownpourRule",
    "AGNRule",
    "ADAGRule",
    "DynSGDRule",
    "AEASGDRule",
    "EAMSGDRule",
    "STRATEGIES",
    "register_strategies",
]
