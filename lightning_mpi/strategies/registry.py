"""One table of strategy names, registered with every Lightning package the program imports.

``import lightning_mpi`` imports no Lightning package. It asks to be told when one is imported
(``wrapt``'s post-import hooks; at once for a package already imported) and then registers every
name below with that package's registry: ``StrategyRegistry`` for the Trainers
(``pytorch_lightning``, ``lightning.pytorch``), ``STRATEGY_REGISTRY`` for Fabric
(``lightning_fabric``, ``lightning.fabric``). So ``Trainer(strategy="mpi_asa16")`` and
``Fabric(strategy="mpi_asa16")`` work whichever package the user imports, and in whichever order.

Each Trainer's registry also gets the class paths of lightning_mpi's strategy classes built on the
other Trainer package (:func:`class_path_names`), as names that refuse with a message naming the
class to use: a LightningCLI of ``lightning.pytorch`` hands ``--trainer.strategy=lightning_mpi.EASGDStrategy``
(built on ``pytorch_lightning``) on to its Trainer as a plain string, lower-cased, since jsonargparse
resolves only subclasses of that Trainer's ``Strategy``. A registry entry is the one supported place
where lightning_mpi can answer a strategy string: Lightning's own "invalid strategy" error, for any
other unknown string, has no hook.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from lightning_mpi.strategies.packages import twin_path

#: name -> (strategy class name, init params, description)
STRATEGIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "mpi_allreduce": ("SyncStrategy", {"exchange": "allreduce"}, "Synchronous: average gradients with MPI_Allreduce"),
    "mpi_asa": ("SyncStrategy", {"exchange": "asa"}, "Synchronous: Alltoall, fp32 sum, Allgather (Theano-MPI ASA)"),
    "mpi_asa16": (
        "SyncStrategy",
        {"exchange": "asa", "wire": "fp16"},
        "Synchronous ASA with fp16 on the wire, fp32 sums",
    ),
    "mpi_asa_bf16": (
        "SyncStrategy",
        {"exchange": "asa", "wire": "bf16"},
        "Synchronous ASA with bf16 on the wire, fp32 sums",
    ),
    "mpi_asa_int8": (
        "CompressedSyncStrategy",
        {"wire": "int8"},
        "Synchronous ASA with int8 min-max quantization, fp32 sums, error feedback",
    ),
    "mpi_topk": (
        "CompressedSyncStrategy",
        {"wire": "topk"},
        "Synchronous top-k sparsified exchange of (index, value) pairs, error feedback",
    ),
    "mpi_onebit": (
        "CompressedSyncStrategy",
        {"wire": "onebit"},
        "Synchronous ASA with 1-bit signs and per-chunk scales, error feedback",
    ),
    "mpi_easgd": ("EASGDStrategy", {}, "Synchronous elastic averaging (Zhang et al. 2015), center kept by allreduce"),
    "mpi_model_avg": ("ModelAveragingStrategy", {}, "Periodic model averaging (local SGD)"),
    "mpi_aeasgd": ("AEASGDStrategy", {}, "Asynchronous EASGD against a center sharded over all ranks"),
    "mpi_eamsgd": ("EAMSGDStrategy", {}, "Asynchronous EASGD with Nesterov momentum, sharded center"),
    "mpi_downpour": ("DownpourStrategy", {}, "DOWNPOUR: commit accumulated delta, pull the sharded center"),
    "mpi_agn": ("AGNStrategy", {}, "Accumulated gradient normalization: commit delta / period"),
    "mpi_adag": ("ADAGStrategy", {}, "ADAG: commit scaled by 1/(|center moved|^2/eta + 1)"),
    "mpi_dynsgd": ("DynSGDStrategy", {}, "DynSGD: commit divided by staleness + 1"),
    "mpi_gosgd": ("GoSGDStrategy", {}, "GoSGD gossip: push to a random peer with probability p, weighted merge"),
    "mpi_powersgd": (
        "PowerSGDStrategy",
        {},
        "PowerSGD: rank-r P Q^T approximation by one warm-started power step, error feedback",
    ),
    "mpi_diloco": (
        "DiLoCoStrategy",
        {},
        "DiLoCo: H local steps, then outer Nesterov SGD on the averaged pseudo-gradient",
    ),
    "mpi_streaming_diloco": (
        "StreamingDiLoCoStrategy",
        {},
        "Streaming DiLoCo: fragments synced in turn, overlapped, 4-bit",
    ),
    "mpi_hybrid": (
        "HybridStrategy",
        {},
        "Two levels: every-step ASA inside each host, Streaming DiLoCo across hosts, each rank carrying its piece",
    ),
    "mpi_auto": (
        "AutoStrategy",
        {},
        "Chosen from the measured link: every-step ASA fp16, PowerSGD, or Streaming DiLoCo tuned to the link",
    ),
    "mpi_zero": (
        "SyncStrategy",
        {"exchange": "asa", "shard_optimizer": True, "bucket_mb": 4.0},
        "Synchronous ASA with the optimizer state sharded over the ranks (ZeRO stages 1 and 2), fp32 wire",
    ),
    "mpi_zero_bf16": (
        "SyncStrategy",
        {"exchange": "asa", "wire": "bf16", "shard_optimizer": True, "bucket_mb": 4.0},
        "Synchronous ASA with the optimizer state sharded over the ranks (ZeRO stages 1 and 2), bf16 wire",
    ),
}

TRAINER_PACKAGES = ("pytorch_lightning", "lightning.pytorch")
FABRIC_PACKAGES = ("lightning_fabric", "lightning.fabric")


def class_path_names(package: str) -> dict[str, str]:
    """For a Trainer package: the lower-cased class path of every lightning_mpi strategy class built on
    the other Trainer package (``"lightning_mpi.easgdstrategy"`` for ``lightning.pytorch``), each
    with the message that refuses it there, naming the class built on ``package`` and a name that
    builds it."""
    (other,) = (p for p in TRAINER_PACKAGES if p != package)
    class_names = sorted({class_name for class_name, _, _ in STRATEGIES.values()} | {"MPIStrategy", "AsyncMPIStrategy"})
    found = {}
    for class_name in class_names:
        given, right = twin_path(class_name, other), twin_path(class_name, package)
        names = [name for name, (class_of_name, _, _) in STRATEGIES.items() if class_of_name == class_name]
        by_name = f", or the name {names[0]!r}" if names else ""
        found[given.lower()] = (
            f"{given.lower()!r} was taken as a strategy name: the class `{given}` is not built on {package}. "
            f"Use `{right}` (with LightningCLI: --trainer.strategy={right}){by_name}."
        )
    return found


def _refusal(message: str) -> Callable[..., Any]:
    """A registry entry's factory that raises ``ValueError(message)`` instead of building a strategy."""

    def refuse(**_: Any) -> Any:
        raise ValueError(message)

    return refuse


def register_strategies(package: str | None = None) -> None:
    """Register every name in :data:`STRATEGIES` with ``package``'s registry (idempotent), or with
    every Lightning package already imported when ``package`` is None.

    Also gives ``package`` this process's rank from the MPI launcher's environment (see
    :mod:`.launch_rank`), so that its rank-zero messages before any strategy exists (``No seed
    found``) print once, and, for a Trainer, registers the other Trainer package's class paths as
    names that refuse with the class to use (:func:`class_path_names`).
    """
    # Here, not at the top: ``import lightning_mpi`` imports this module and must stay free of torch
    # and Lightning; the classes are built only once a Lightning package is imported.
    from lightning_mpi.strategies import build, launch_rank, lightning_api

    if package is None:
        for imported in TRAINER_PACKAGES + FABRIC_PACKAGES:
            if imported in sys.modules:
                register_strategies(imported)
        return
    if package in TRAINER_PACKAGES:
        classes, registry = build.trainer_classes(package), lightning_api.trainer_api(package).registry
    elif package in FABRIC_PACKAGES:
        classes, registry = build.fabric_classes(package), lightning_api.fabric_api(package).registry
    else:
        raise ValueError(
            f"package={package!r} is not a Lightning package: choose one of {list(TRAINER_PACKAGES + FABRIC_PACKAGES)}"
        )
    launch_rank.tell_lightning(package)  # rank-zero output before any strategy exists
    for name, (class_name, params, description) in STRATEGIES.items():
        registry.register(name, classes[class_name], description=description, override=True, **params)
    if package in TRAINER_PACKAGES:
        for path, message in class_path_names(package).items():
            registry.register(path, _refusal(message), description=message, override=True)


def _register_on_import(package: str) -> Any:
    def hook(module: Any) -> None:
        try:
            register_strategies(package)
        except Exception as error:  # an unsupported Lightning version must not break the user's import
            warnings.warn(
                f"lightning_mpi: could not register its strategies with {package}: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    return hook


def install_registration_hooks() -> None:
    """Register with each Lightning package now if it is imported, else as soon as it is."""
    import wrapt  # here, with the one call that needs it, so that `import lightning_mpi` stays fast

    for package in TRAINER_PACKAGES + FABRIC_PACKAGES:
        wrapt.register_post_import_hook(_register_on_import(package), package)
