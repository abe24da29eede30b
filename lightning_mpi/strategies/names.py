"""What to add to Lightning's "invalid strategy" error when the strategy was meant for lightning_mpi.

Lightning answers an unknown strategy with a generic list (``auto, ddp, ddp_spawn, deepspeed, ...``)
that holds none of the ``mpi_*`` names. :func:`strategy_hint` says what the user most likely meant:

- a mistyped name (``"mpi_asa61"``, ``"asa16"``, ``"mpi-easgd"``): the closest ``mpi_*`` name
  (``difflib``) and the list of them;
- a lightning_mpi class path given as a name (``"lightning_mpi.EASGDStrategy"``: LightningCLI passes a
  class path on as a plain string when the class is not a subclass of its Trainer's ``Strategy``,
  and Lightning lower-cases it): the class built on that Trainer's package;
- a lightning_mpi strategy instance built on another Lightning package: the one built on this one
  (:func:`~lightning_mpi.strategies.packages.other_package_message`).

Pure functions of the flag and of the package whose Trainer or Fabric refused it.
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning_mpi.strategies.packages import EXPORTS, other_package_message, twin_path
from lightning_mpi.strategies.registry import STRATEGIES

#: Cut-off of ``difflib.get_close_matches`` for a suggestion ("asa16" -> "mpi_asa16" scores 0.71).
CLOSENESS = 0.6


def mpi_names() -> list[str]:
    """Every registered ``mpi_*`` name, sorted."""
    return sorted(STRATEGIES)


def closest_mpi_name(name: str) -> str | None:
    """The ``mpi_*`` name closest to ``name`` (case-insensitive), or ``None`` if none is close."""
    matches = difflib.get_close_matches(name.lower().replace("-", "_"), mpi_names(), n=1, cutoff=CLOSENESS)
    return matches[0] if matches else None


def unknown_name_hint(name: str) -> str | None:
    """For an unregistered strategy name that looks like one of ours (it starts with ``mpi`` or is
    close to an ``mpi_*`` name): the closest name and the list; else ``None``."""
    if name.lower() in STRATEGIES:
        return None
    closest = closest_mpi_name(name)
    if closest is None and not name.lower().startswith("mpi"):
        return None
    guess = f" Did you mean {closest!r}?" if closest is not None else ""
    return (
        f"Unknown strategy name {name!r}.{guess} lightning_mpi's names are: {', '.join(mpi_names())} "
        "(every name and its arguments: docs/strategies.md)."
    )


def _strategy_class_names() -> list[str]:
    return sorted({class_name for class_name, _, _ in STRATEGIES.values()} | {"MPIStrategy", "AsyncMPIStrategy"})


def class_path_hint(name: str, package: str) -> str | None:
    """For a lightning_mpi class path used as a strategy name (``"lightning_mpi.easgdstrategy"``), the
    class built on ``package`` and a name that builds it; else ``None``."""
    module, _, class_name = name.rpartition(".")
    modules = {exported.lower(): exported for exported in EXPORTS.values()}
    if module.lower() not in modules:
        return None
    by_lower = {known.lower(): known for known in _strategy_class_names()}
    known = by_lower.get(class_name.lower())
    if known is None:
        return (
            f"{name!r} is not a lightning_mpi strategy class. The strategy classes for {package} are "
            f"{EXPORTS[package]}.<class>, <class> one of: {', '.join(_strategy_class_names())}."
        )
    given = f"{modules[module.lower()]}.{known}"  # Lightning lower-cases the flag: give it its case back
    names = [mpi for mpi, (class_of_name, _, _) in STRATEGIES.items() if class_of_name == known]
    by_name = f", or the name {names[0]!r}" if names else ""
    right = twin_path(known, package)
    if given == right:  # the right class, passed as a string in Python
        return f"{name!r} is a class path, not a strategy name: pass an instance, `{right}(...)`{by_name}."
    return (
        f"{name!r} was taken as a strategy name: the class `{given}` is not built on {package}. "
        f"Use `{right}` (with LightningCLI: --trainer.strategy={right}){by_name}."
    )


def strategy_hint(strategy: Any, package: str) -> str | None:
    """What to add to the error of ``package``'s Trainer or Fabric about ``strategy``, or ``None``."""
    if isinstance(strategy, str):
        return class_path_hint(strategy, package) or unknown_name_hint(strategy)
    return other_package_message(strategy, package)
