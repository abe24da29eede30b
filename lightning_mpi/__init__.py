"""lightning_mpi: PyTorch Lightning strategies for data-parallel training over MPI.

``import lightning_mpi`` registers every ``mpi_*`` strategy name with Lightning, so
``Trainer(strategy="mpi_asa16")`` works.
"""
from lightning_mpi.registry import STRATEGIES, register_strategies
from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.sync import SyncRule
from lightning_mpi.strategy import MPIStrategy, SyncStrategy

__version__ = "0.1.0"

register_strategies()

__all__ = ["MPIStrategy", "SyncStrategy", "SyncRule", "Rule", "BoundRule", "STRATEGIES", "register_strategies"]
