"""Argument checks shared by the sharding rule, the loader and the DataModule.

Each raises ``ValueError`` naming the caller, the argument, the allowed range and the value, so
a bad argument fails the same way on every rank before any MPI communication.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

__all__ = ["check_bool", "check_dataset", "check_int"]


def check_int(name: str, value: Any, minimum: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
    return bool(value)


def check_dataset(name: str, dataset: Any, where: str) -> int:
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"{where}: {name} must be a map-style dataset (__len__ and __getitem__); an IterableDataset "
            "cannot be sharded by index"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(
            f"{where}: {name} must be a map-style dataset with __len__ and __getitem__, got {type(dataset).__name__}"
        )
    n = len(dataset)
    if n < 1:
        raise ValueError(f"{where}: {name} must hold at least 1 sample, got len({name}) == {n}")
    return n
