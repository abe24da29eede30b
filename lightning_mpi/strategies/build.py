"""Builds lightning_mpi's Lightning classes on the package the user imported.

Each Lightning package has its own base classes, and its Trainer or Fabric accepts only
strategies (callbacks, DataModules) built on them. The behaviour is written once
(:func:`.trainer.trainer_strategy`, :func:`.fabric.fabric_strategy`, the rules' options, the hooks
of the DataModule and the callback); this module puts each package's base classes under it, once
per package and on first use:

=====================  ==================================  ==============================
package                classes                             built by
=====================  ==================================  ==============================
``pytorch_lightning``  ``lightning_mpi.SyncStrategy``, ...  :func:`trainer_classes`
``lightning.pytorch``  ``lightning_mpi.lightning.*``        :func:`trainer_classes`
``lightning_fabric``   ``lightning_mpi.lightning_fabric.*`` :func:`fabric_classes`
``lightning.fabric``   ``lightning_mpi.fabric.*``           :func:`fabric_classes`
=====================  ==================================  ==============================

A named strategy (``EASGDStrategy``) is the frontend's ``MPIStrategy`` (``AsyncMPIStrategy`` for
asynchronous rules) whose arguments are its rule's options (:func:`.signatures.named_strategy`):
no strategy is written twice, and no argument either.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from lightning_mpi.data.hooks import PrefetchDataHooks
from lightning_mpi.offload.hooks import LMSOffloadHooks
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.catalog import RULES
from lightning_mpi.strategies.checkpoint_io import AtomicWriteMixin
from lightning_mpi.strategies.environment import MPIClusterMixin
from lightning_mpi.strategies.fabric.strategy import fabric_strategy
from lightning_mpi.strategies.lightning_api import fabric_api, trainer_api
from lightning_mpi.strategies.packages import guarded_trainer_attribute
from lightning_mpi.strategies.signatures import named_strategy
from lightning_mpi.strategies.trainer.strategy import trainer_strategy

#: Where each package's classes are exported (their ``__module__``, so class paths resolve).
EXPORTS = {
    "pytorch_lightning": "lightning_mpi",
    "lightning.pytorch": "lightning_mpi.lightning",
    "lightning_fabric": "lightning_mpi.lightning_fabric",
    "lightning.fabric": "lightning_mpi.fabric",
}

#: Strategy class name -> the rule it trains with (its arguments are the rule's options): ``EASGDRule``
#: is trained by ``EASGDStrategy``.
STRATEGY_RULES: dict[str, type[Rule]] = {rule.__name__.removesuffix("Rule") + "Strategy": rule for rule in RULES}

_ASYNC_DOC = """Base of the asynchronous strategies (parameter-server and gossip rules): Lightning's stop
decisions are answered without per-step barriers, and ``implicit_momentum_correction`` is available.
Otherwise the same as ``MPIStrategy``."""


def _make(name: str, bases: tuple[type, ...], module: str, doc: str | None, **attributes: Any) -> type:
    """A class named ``name`` that reports ``module`` as its home (so pickling, ``repr`` and
    LightningCLI class paths find it there) and carries ``doc`` (LightningCLI reads it)."""
    return type(name, bases, {"__module__": module, "__qualname__": name, "__doc__": doc, **attributes})


def _exported(cls: type, module: str) -> type:
    """``cls`` (made by a factory function), reporting ``module`` as its home."""
    cls.__module__ = module
    cls.__qualname__ = cls.__name__
    return cls


@cache
def _fabric_support(package: str) -> dict[str, type]:
    """The cluster environment and checkpoint IO on Fabric package ``package``."""
    api = fabric_api(package)
    module = EXPORTS[package]
    return {
        "MPIClusterEnvironment": _make(
            "MPIClusterEnvironment", (MPIClusterMixin, api.MPIEnvironment), module, MPIClusterMixin.__doc__
        ),
        "AtomicCheckpointIO": _make(
            "AtomicCheckpointIO",
            (AtomicWriteMixin, api.TorchCheckpointIO),
            module,
            AtomicWriteMixin.__doc__,
            get_filesystem=staticmethod(api.get_filesystem),
        ),
    }


def _strategies_on(base: type, module: str) -> dict[str, type]:
    """``MPIStrategy`` (``base``), ``AsyncMPIStrategy`` and every named strategy on it."""
    async_base = _make("AsyncMPIStrategy", (base,), module, _ASYNC_DOC)
    classes = {"MPIStrategy": base, "AsyncMPIStrategy": async_base}
    for name, rule_class in STRATEGY_RULES.items():
        classes[name] = named_strategy(name, rule_class, async_base if rule_class.asynchronous else base, module)
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


@cache
def _build_trainer_classes(package: str) -> dict[str, type]:
    api = trainer_api(package)
    support = _fabric_support(api.fabric.package)
    module = EXPORTS[package]
    base = _exported(trainer_strategy(api, support["MPIClusterEnvironment"], support["AtomicCheckpointIO"]), module)
    return {**support, **_strategies_on(base, module), **_trainer_extras(api, module)}


def _trainer_extras(api: Any, module: str) -> dict[str, type]:
    """The DataModule and the callback, on the Trainer package's bases."""
    return {
        "PrefetchDataModule": _make(
            "PrefetchDataModule",
            (PrefetchDataHooks, api.LightningDataModule),
            module,
            PrefetchDataHooks.__doc__,
            # a Trainer of the other Lightning package gets an error naming the right class
            trainer=guarded_trainer_attribute(api.package),
        ),
        "LMSOffload": _make("LMSOffload", (LMSOffloadHooks, api.Callback), module, LMSOffloadHooks.__doc__),
    }


@cache
def _build_fabric_classes(package: str) -> dict[str, type]:
    api = fabric_api(package)
    support = _fabric_support(package)
    module = EXPORTS[package]
    base = _exported(fabric_strategy(api, support["MPIClusterEnvironment"], support["AtomicCheckpointIO"]), module)
    return {**support, **_strategies_on(base, module)}
