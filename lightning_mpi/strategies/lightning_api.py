"""The Lightning names the strategy layer uses, looked up in one package family.

Lightning ships the same code under two names: the standalone packages (``pytorch_lightning``
with ``lightning_fabric``) and the unified package (``lightning.pytorch`` with
``lightning.fabric``). Their classes are distinct: a Trainer from one rejects a strategy, a callback
or a DataModule built on the other. So the strategy layer never imports Lightning at module level;
it asks this module for the names of the package the user imported, and
:mod:`lightning_mpi.strategies.build` builds its classes on them.

Only the package asked for is imported: a program that uses ``lightning`` never loads
``pytorch_lightning``, and a Fabric-only program never loads a Trainer package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

#: Trainer package -> the Fabric package it is built on.
FABRIC_OF = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}


def _get(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class FabricAPI:
    """Names from one Fabric package (``lightning_fabric`` or ``lightning.fabric``)."""

    package: str
    ParallelStrategy: type
    BackwardSyncControl: type
    MPIEnvironment: type
    TorchCheckpointIO: type
    registry: Any  # the package's STRATEGY_REGISTRY
    rank_zero_only: Any
    rank_zero_info: Any
    rank_zero_warn: Any
    get_filesystem: Any
    optimizers_to_device: Any
    unwrap_objects: Any  # Fabric's wrappers of modules, optimizers and loaders, taken off


@dataclass(frozen=True)
class TrainerAPI:
    """Names from one Trainer package (``pytorch_lightning`` or ``lightning.pytorch``) and its Fabric."""

    package: str
    fabric: FabricAPI
    ParallelStrategy: type
    Callback: type
    LightningDataModule: type
    ModelCheckpoint: type
    TrainerFn: Any
    RunningStage: Any
    registry: Any  # the package's StrategyRegistry
    rank_zero_only: Any
    update_dataloader: Any
    get_distributed_sampler: Any
    is_dataloader_shuffled: Any


@cache
def fabric_api(package: str) -> FabricAPI:
    """The names of Fabric package ``package`` ("lightning_fabric" or "lightning.fabric"); imports it."""
    if package not in FABRIC_OF.values():
        raise ValueError(f"package={package!r} is not a Fabric package: choose one of {sorted(FABRIC_OF.values())}")
    return FabricAPI(
        package=package,
        ParallelStrategy=_get(f"{package}.strategies", "ParallelStrategy"),
        BackwardSyncControl=_get(f"{package}.strategies.strategy", "_BackwardSyncControl"),
        MPIEnvironment=_get(f"{package}.plugins.environments", "MPIEnvironment"),
        TorchCheckpointIO=_get(f"{package}.plugins.io", "TorchCheckpointIO"),
        registry=_get(f"{package}.strategies", "STRATEGY_REGISTRY"),
        rank_zero_only=_get(f"{package}.utilities.rank_zero", "rank_zero_only"),
        rank_zero_info=_get(f"{package}.utilities.rank_zero", "rank_zero_info"),
        rank_zero_warn=_get(f"{package}.utilities.rank_zero", "rank_zero_warn"),
        get_filesystem=_get(f"{package}.utilities.cloud_io", "get_filesystem"),
        optimizers_to_device=_get(f"{package}.utilities.optimizer", "_optimizers_to_device"),
        unwrap_objects=_get(f"{package}.wrappers", "_unwrap_objects"),
    )


@cache
def trainer_api(package: str) -> TrainerAPI:
    """The names of Trainer package ``package`` ("pytorch_lightning" or "lightning.pytorch"); imports it."""
    if package not in FABRIC_OF:
        raise ValueError(f"package={package!r} is not a Trainer package: choose one of {sorted(FABRIC_OF)}")
    return TrainerAPI(
        package=package,
        fabric=fabric_api(FABRIC_OF[package]),
        ParallelStrategy=_get(f"{package}.strategies", "ParallelStrategy"),
        Callback=_get(f"{package}.callbacks", "Callback"),
        LightningDataModule=_get(package, "LightningDataModule"),
        ModelCheckpoint=_get(f"{package}.callbacks", "ModelCheckpoint"),
        TrainerFn=_get(f"{package}.trainer.states", "TrainerFn"),
        RunningStage=_get(f"{package}.trainer.states", "RunningStage"),
        registry=_get(f"{package}.strategies", "StrategyRegistry"),
        rank_zero_only=_get(f"{package}.utilities.rank_zero", "rank_zero_only"),
        update_dataloader=_get(f"{package}.utilities.data", "_update_dataloader"),
        get_distributed_sampler=_get(f"{package}.trainer.connectors.data_connector", "_get_distributed_sampler"),
        is_dataloader_shuffled=_get(f"{package}.utilities.data", "_is_dataloader_shuffled"),
    )
