"""Which Lightning package a lightning_mpi class is built on, and what to say when it meets another.

Lightning ships the same classes twice, in the standalone packages (``pytorch_lightning``,
``lightning_fabric``) and in the unified package (``lightning.pytorch``, ``lightning.fabric``), and
each Trainer or Fabric takes only strategies and DataModules built on its own package. lightning_mpi
therefore has one set of classes per package (``lightning_mpi.SyncStrategy`` on
``pytorch_lightning``, ``lightning_mpi.lightning.SyncStrategy`` on ``lightning.pytorch``, ...), and a
class from the wrong set used to fail deep inside Lightning (``ValueError: Expected a parent``).
These functions name the class the user wanted instead:

- :func:`other_package_message`: the message, given the object and the package that refused it;
- :func:`guarded_trainer_attribute`: a ``trainer`` attribute for a DataModule, which Lightning sets
  before it first looks at the DataModule's methods, that raises ``TypeError`` with that message
  when a Trainer of another package attaches it;
- :func:`warn_if_other_package`: a warning when a program that imports one Lightning package asks
  for the classes of a package it never imported (a LightningCLI class path such as
  ``lightning_mpi.EASGDStrategy`` under ``lightning.pytorch.cli`` fails inside jsonargparse,
  where no hook of ours runs; this warning, printed as the class is looked up, names the right one).

Nothing here imports Lightning: classes are recognised by their modules' names.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

#: Lightning package -> where lightning_mpi exports its classes built on it.
EXPORTS = {
    "pytorch_lightning": "lightning_mpi",
    "lightning.pytorch": "lightning_mpi.lightning",
    "lightning_fabric": "lightning_mpi.lightning_fabric",
    "lightning.fabric": "lightning_mpi.fabric",
}

#: Lightning package -> how a user writes its frontend.
FRONTENDS = {
    "pytorch_lightning": "pytorch_lightning's Trainer (import pytorch_lightning as pl)",
    "lightning.pytorch": "lightning.pytorch's Trainer (import lightning as L; L.Trainer)",
    "lightning_fabric": "lightning_fabric's Fabric (import lightning_fabric)",
    "lightning.fabric": "lightning.fabric's Fabric (import lightning as L; L.Fabric)",
}


def package_of_module(module: str) -> str | None:
    """The Lightning package that module ``module`` belongs to (``"lightning.pytorch.trainer"`` ->
    ``"lightning.pytorch"``), or ``None``."""
    for package in EXPORTS:
        if module == package or module.startswith(package + "."):
            return package
    return None


def package_of(cls: type) -> str | None:
    """The Lightning package ``cls`` is built on: that of the first Lightning class in its MRO."""
    for klass in getattr(cls, "__mro__", ()):
        package = package_of_module(getattr(klass, "__module__", "") or "")
        if package is not None:
            return package
    return None


def is_lightning_mpi_class(cls: type) -> bool:
    """True for a class lightning_mpi exports on one of the Lightning packages."""
    return cls.__module__ in EXPORTS.values() and package_of(cls) is not None


def twin_path(class_name: str, package: str) -> str:
    """Where lightning_mpi's class ``class_name`` built on ``package`` lives, as an import path."""
    return f"{EXPORTS[package]}.{class_name}"


def other_package_message(obj: Any, package: str) -> str | None:
    """What to tell a user who gave ``obj``, a lightning_mpi object built on one Lightning package,
    to a Trainer or Fabric of ``package``; ``None`` for any other object (or one built on ``package``)."""
    cls = type(obj)
    if not is_lightning_mpi_class(cls):
        return None
    built_on = package_of(cls)
    if built_on == package:
        return None
    return (
        f"`{cls.__module__}.{cls.__name__}` is built on {built_on}, but {FRONTENDS[package]} takes only classes "
        f"built on {package}: use `{twin_path(cls.__name__, package)}`, the same class with the same arguments."
    )


def guarded_trainer_attribute(package: str) -> property:
    """A ``trainer`` attribute for a lightning_mpi DataModule built on ``package``.

    Lightning sets ``datamodule.trainer`` when it attaches the DataModule, before it inspects the
    DataModule's methods (where a DataModule of the other package fails with ``Expected a
    parent``); a Trainer of another package raises ``TypeError`` here instead, naming the class to use.
    """
    slot = "_lightning_mpi_trainer"

    def get(self: Any) -> Any:
        return self.__dict__.get(slot)

    def set_(self: Any, trainer: Any) -> None:
        if trainer is not None:
            trainer_package = package_of(type(trainer))
            if trainer_package is not None and trainer_package != package:
                message = other_package_message(self, trainer_package)
                if message is not None:
                    raise TypeError(message)
        self.__dict__[slot] = trainer

    return property(get, set_, doc="The Trainer this DataModule is attached to (``None`` before).")


def warn_if_other_package(package: str, class_name: str | None = None) -> None:
    """Warn when lightning_mpi's ``class_name`` (or, with ``None``, its module) built on ``package``
    is looked up by a program that uses another Lightning package of the same kind and has not
    imported ``package`` itself, so that the class could only be refused there. Call it before the
    lookup imports ``package``."""
    if package in sys.modules:
        return
    trainers = ("pytorch_lightning", "lightning.pytorch")
    kind = trainers if package in trainers else ("lightning_fabric", "lightning.fabric")
    used = [other for other in kind if other != package and other in sys.modules]
    if not used:
        return
    asked, instead = (
        (twin_path(class_name, package), twin_path(class_name, used[0]))
        if class_name is not None
        else (EXPORTS[package], EXPORTS[used[0]])
    )
    warnings.warn(
        f"lightning_mpi: `{asked}` is built on {package}, which this program has not imported; it uses "
        f"{used[0]}, so use `{instead}`. {used[0]} refuses strategies and DataModules built on {package}.",
        UserWarning,
        stacklevel=3,
    )
