"""Builds lightning_mpi's Lightning classes on the package the user imported.

Each Lightning package has its own base classes, and its Trainer or Fabric accepts only
strategies (callbacks, DataModules) built on them. The behaviour is written once, in mixins that
import no Lightning (:mod:`.trainer`, :mod:`.fabric`, :mod:`.decisions`, :mod:`.options`, ...);
this module puts them on each package's bases, once per package and on first use:

=====================  ==================================  ==============================
package                classes                             built by
=====================  ==================================  ==============================
``pytorch_lightning``  ``lightning_mpi.SyncStrategy``, ...  :func:`trainer_classes`
``lightning.pytorch``  ``lightning_mpi.lightning.*``        :func:`trainer_classes`
``lightning_fabric``   ``lightning_mpi.lightning_fabric.*`` :func:`fabric_classes`
``lightning.fabric``   ``lightning_mpi.fabric.*``           :func:`fabric_classes`
=====================  ==================================  ==============================

Every strategy class is ``<options> + <frontend base>``: the options class (typed arguments that
build a rule) is the same for every frontend, so no strategy is written twice.
"""
from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from lightning_mpi.strategies import low_communication_options, options
from lightning_mpi.strategies.checkpoint_io import AtomicWriteMixin
from lightning_mpi.strategies.decisions import StopDecisions
from lightning_mpi.strategies.environment import MPIClusterMixin
from lightning_mpi.strategies.fabric import FabricMPIStrategy, _NoBackwardSync
from lightning_mpi.strategies.lightning_api import fabric_api, trainer_api
from lightning_mpi.strategies.packages import guarded_trainer_attribute  # issue 27: DataModule of the other package
from lightning_mpi.strategies.preemption import PreemptionCheckpoint
from lightning_mpi.strategies.resume import ResumeOnRestart
from lightning_mpi.strategies.sharding import LoaderSharding
from lightning_mpi.strategies.trainer import TrainerMPIStrategy

#: Where each package's classes are exported (their ``__module__``, so class paths resolve).
EXPORTS = {
    "pytorch_lightning": "lightning_mpi",
    "lightning.pytorch": "lightning_mpi.lightning",
    "lightning_fabric": "lightning_mpi.lightning_fabric",
    "lightning.fabric": "lightning_mpi.fabric",
}

#: Strategy class name -> (its options class, whether it is asynchronous).
STRATEGY_CLASSES: dict[str, tuple[type, bool]] = {
    "SyncStrategy": (options.SyncOptions, False),
    "CompressedSyncStrategy": (options.CompressedSyncOptions, False),
    "EASGDStrategy": (options.EASGDOptions, False),
    "ModelAveragingStrategy": (options.ModelAveragingOptions, False),
    "DownpourStrategy": (options.DownpourOptions, True),
    "AGNStrategy": (options.AGNOptions, True),
    "ADAGStrategy": (options.ADAGOptions, True),
    "DynSGDStrategy": (options.DynSGDOptions, True),
    "AEASGDStrategy": (options.AEASGDOptions, True),
    "EAMSGDStrategy": (options.EAMSGDOptions, True),
    "GoSGDStrategy": (options.GoSGDOptions, True),
    "PowerSGDStrategy": (low_communication_options.PowerSGDOptions, False),
    "DiLoCoStrategy": (low_communication_options.DiLoCoOptions, False),
    "StreamingDiLoCoStrategy": (low_communication_options.StreamingDiLoCoOptions, False),
}


def _make(name: str, bases: tuple[type, ...], module: str, doc: str | None, **attributes: Any) -> type:
    """A class named ``name`` that reports ``module`` as its home (so pickling, ``repr`` and
    LightningCLI class paths find it there) and carries ``doc`` (LightningCLI reads it)."""
    return type(name, bases, {"__module__": module, "__qualname__": name, "__doc__": doc, **attributes})


@lru_cache(maxsize=None)
def _fabric_support(package: str) -> dict[str, type]:
    """The cluster environment and checkpoint IO on Fabric package ``package``."""
    api = fabric_api(package)
    module = EXPORTS[package]
    return {
        "MPIClusterEnvironment": _make("MPIClusterEnvironment", (MPIClusterMixin, api.MPIEnvironment), module,
                                       MPIClusterMixin.__doc__),
        "AtomicCheckpointIO": _make("AtomicCheckpointIO", (AtomicWriteMixin, api.TorchCheckpointIO), module,
                                    AtomicWriteMixin.__doc__, get_filesystem=staticmethod(api.get_filesystem)),
    }


def _strategies_on(base: type, async_base: type, module: str) -> dict[str, type]:
    classes = {"MPIStrategy": base, "AsyncMPIStrategy": async_base}
    for name, (options_class, is_async) in STRATEGY_CLASSES.items():
        parent = async_base if is_async else base
        classes[name] = _make(name, (options_class, parent), module, options_class.__doc__)
    return classes


def trainer_classes(package: str) -> dict[str, type]:
    """Every Trainer-side class of lightning_mpi, built on ``package`` ("pytorch_lightning" or
    "lightning.pytorch"), by public name; the same objects on every call."""
    # Import the package before building: its post-import hook registers the names, and so builds
    # the classes, first. Building first would import the package halfway through the build, and
    # the hook would build (and register) a second set of classes.
    importlib.import_module(package)
    return _build_trainer_classes(package)


def fabric_classes(package: str) -> dict[str, type]:
    """Every Fabric-side class of lightning_mpi, built on ``package`` ("lightning_fabric" or
    "lightning.fabric"), by public name; the same objects on every call."""
    importlib.import_module(package)  # see trainer_classes
    return _build_fabric_classes(package)


@lru_cache(maxsize=None)
def _build_trainer_classes(package: str) -> dict[str, type]:
    api = trainer_api(package)
    support = _fabric_support(api.fabric.package)
    module = EXPORTS[package]
    base = _make(
        "MPIStrategy", (LoaderSharding, ResumeOnRestart, PreemptionCheckpoint, TrainerMPIStrategy, api.ParallelStrategy),
        module, TrainerMPIStrategy.__doc__,
        _api=api, _fabric_api=api.fabric,
        _environment_class=support["MPIClusterEnvironment"], _checkpoint_io_class=support["AtomicCheckpointIO"],
    )
    async_base = _make("AsyncMPIStrategy", (options.AsyncOptions, StopDecisions, base), module,
                       options.AsyncOptions.__doc__)
    return {**support, **_strategies_on(base, async_base, module), **_trainer_extras(api, module)}


def _trainer_extras(api: Any, module: str) -> dict[str, type]:
    """The DataModule and the callback, on the Trainer package's bases."""
    from lightning_mpi.data.hooks import PrefetchDataHooks
    from lightning_mpi.offload.hooks import LMSOffloadHooks

    return {
        "PrefetchDataModule": _make("PrefetchDataModule", (PrefetchDataHooks, api.LightningDataModule), module,
                                    PrefetchDataHooks.__doc__,
                                    trainer=guarded_trainer_attribute(api.package)),  # issue 27: a Trainer of the other package names the right class
        "LMSOffload": _make("LMSOffload", (LMSOffloadHooks, api.Callback), module, LMSOffloadHooks.__doc__),
    }


@lru_cache(maxsize=None)
def _build_fabric_classes(package: str) -> dict[str, type]:
    api = fabric_api(package)
    support = _fabric_support(package)
    module = EXPORTS[package]
    backward_sync = _make("NoBackwardSync", (_NoBackwardSync, api.BackwardSyncControl), module, _NoBackwardSync.__doc__)
    base = _make(
        "MPIStrategy", (FabricMPIStrategy, api.ParallelStrategy), module, FabricMPIStrategy.__doc__,
        _fabric_api=api, _backward_sync_class=backward_sync,
        _environment_class=support["MPIClusterEnvironment"], _checkpoint_io_class=support["AtomicCheckpointIO"],
    )
    async_base = _make("AsyncMPIStrategy", (options.AsyncOptions, base), module, options.AsyncOptions.__doc__)
    return {**support, **_strategies_on(base, async_base, module)}
