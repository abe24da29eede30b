"""lightning_mpi: Lightning strategies for data-parallel training over MPI.

``import lightning_mpi`` registers every ``mpi_*`` strategy name with each Lightning package the
program uses (``pytorch_lightning``, ``lightning.pytorch``, ``lightning_fabric``,
``lightning.fabric``), whether it is imported before or after, so ``Trainer(strategy="mpi_asa16")``
and ``Fabric(strategy="mpi_asa16")`` work. It imports no Lightning package itself.

Classes, by the package they are built on:

- ``pytorch_lightning``: ``lightning_mpi.SyncStrategy``, ``lightning_mpi.LMSOffload``, ... (this module);
- ``lightning`` / ``lightning.pytorch``: :mod:`lightning_mpi.lightning`;
- ``lightning.fabric`` (``L.Fabric``): :mod:`lightning_mpi.fabric`;
- ``lightning_fabric``: :mod:`lightning_mpi.lightning_fabric`.

Names (and those three modules, ``lightning_mpi.lightning`` ...) are resolved on first use, so
importing this package stays cheap: it imports neither torch nor any Lightning package.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_mpi.comm.liveness import beat_from_mpi_init
from lightning_mpi.comm.mpienv import apply_mpi_defaults

# Before anything imports mpi4py.MPI (which initialises MPI): see lightning_mpi.comm.mpienv.
apply_mpi_defaults()
# In a job with Open MPI's failure detector on, a live rank answers it from MPI's start on.
beat_from_mpi_init()

# ``X as X``: re-exported public names (``__all__`` below is built, so linters cannot read it)
from lightning_mpi.strategies.registry import STRATEGIES as STRATEGIES  # noqa: E402
from lightning_mpi.strategies.registry import install_registration_hooks  # noqa: E402
from lightning_mpi.strategies.registry import register_strategies as register_strategies  # noqa: E402

__version__ = "0.1.0"

#: Classes built on ``pytorch_lightning`` (see :mod:`lightning_mpi.strategies.build`).
_PYTORCH_LIGHTNING_CLASSES = (
    "MPIStrategy",
    "SyncStrategy",
    "CompressedSyncStrategy",
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
    "PowerSGDStrategy",
    "DiLoCoStrategy",
    "StreamingDiLoCoStrategy",
    "HybridStrategy",
    "AutoStrategy",
    "MPIClusterEnvironment",
    "AtomicCheckpointIO",
    "LMSOffload",
    "PrefetchDataModule",
)

#: Lightning-free names -> the module (or rule family package) that exports them.
_MODULES = {
    "Rule": "lightning_mpi.rules.base",
    "BoundRule": "lightning_mpi.rules.base",
    "SyncRule": "lightning_mpi.rules.sync",
    "CompressedSyncRule": "lightning_mpi.rules.compressed",
    "EASGDRule": "lightning_mpi.rules.easgd",
    "ModelAveragingRule": "lightning_mpi.rules.averaging",
    "GoSGDRule": "lightning_mpi.rules.gossip",
    "PowerSGDRule": "lightning_mpi.rules.powersgd",
    "DownpourRule": "lightning_mpi.rules.server",
    "AGNRule": "lightning_mpi.rules.server",
    "ADAGRule": "lightning_mpi.rules.server",
    "DynSGDRule": "lightning_mpi.rules.server",
    "AEASGDRule": "lightning_mpi.rules.server",
    "EAMSGDRule": "lightning_mpi.rules.server",
    "DiLoCoRule": "lightning_mpi.rules.diloco",
    "StreamingDiLoCoRule": "lightning_mpi.rules.diloco",
    "HybridRule": "lightning_mpi.rules.hybrid",
    "AutoRule": "lightning_mpi.rules.auto",
    "RankFailedError": "lightning_mpi.comm.errors",
}

__all__ = sorted([*_PYTORCH_LIGHTNING_CLASSES, *_MODULES, "STRATEGIES", "register_strategies"])


#: The modules of classes built on the other Lightning packages, reachable as attributes.
_SUBMODULES = ("lightning", "fabric", "lightning_fabric")


def __getattr__(name: str) -> Any:
    if name in _PYTORCH_LIGHTNING_CLASSES:
        # deferred: building the classes imports pytorch_lightning and torch, which
        # ``import lightning_mpi`` must not
        from lightning_mpi.strategies.build import trainer_classes
        from lightning_mpi.strategies.packages import warn_if_other_package

        warn_if_other_package("pytorch_lightning", name)
        return trainer_classes("pytorch_lightning")[name]
    if name in _SUBMODULES:
        return importlib.import_module(f"lightning_mpi.{name}")
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'lightning_mpi' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


install_registration_hooks()
