"""Sharded checkpoints: every rank writes its shard of the optimizer state at once, into one directory.

- :func:`save_sharded` (collective) / :func:`load_sharded`: the directory format and its atomic
  write (:mod:`lightning_mpi.checkpoint.sharded`);
- :func:`consolidate_checkpoint` / ``python -m lightning_mpi.checkpoint consolidate DIR OUT.ckpt``:
  one plain Lightning checkpoint from it (:mod:`lightning_mpi.checkpoint.consolidate`).

Nothing here imports Lightning; names load lazily so that importing the package costs nothing.
"""

from __future__ import annotations

from typing import Any

_NAMES = {
    "save_sharded": "lightning_mpi.checkpoint.sharded",
    "load_sharded": "lightning_mpi.checkpoint.sharded",
    "is_sharded_checkpoint": "lightning_mpi.checkpoint.sharded",
    "ShardFiles": "lightning_mpi.checkpoint.sharded",
    "consolidate_checkpoint": "lightning_mpi.checkpoint.consolidate",
    "consolidate_to_file": "lightning_mpi.checkpoint.consolidate",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'lightning_mpi.checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_NAMES[name]), name)
