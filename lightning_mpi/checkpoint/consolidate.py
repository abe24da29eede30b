"""A sharded checkpoint as one plain checkpoint: the form Lightning's rank-0 save would have written.

Every slot's shard states are assembled into torch's optimizer format
(:func:`lightning_mpi.rules.zero.state.consolidate`); the rest of the checkpoint is rank 0's
replicated part as it was. The result holds only torch tensors, numbers, strings and whatever the
user's own checkpoint held, so ``Model.load_from_checkpoint(out)`` and
``Trainer.fit(ckpt_path=out)`` under ``ddp`` read it without lightning_mpi installed. This runs in one
process, and holds the whole optimizer state in memory once (the output is that size anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mpi.checkpoint.files import write_atomic
from lightning_mpi.checkpoint.sharded import ShardFiles, load_sharded
from lightning_mpi.rules.zero.state import consolidate


def consolidate_checkpoint(directory: Any) -> dict[str, Any]:
    """The plain checkpoint dict of the sharded checkpoint at ``directory``."""
    checkpoint = load_sharded(directory, weights_only=False)
    for key, value in list(checkpoint.items()):
        if _is_shard_files(value):
            checkpoint[key] = consolidate(list(value))
        elif isinstance(value, (list, tuple)) and any(_is_shard_files(v) for v in value):
            items = [consolidate(list(v)) if _is_shard_files(v) else v for v in value]
            checkpoint[key] = type(value)(items) if isinstance(value, tuple) else items
    return checkpoint


def _is_shard_files(value: Any) -> bool:
    return isinstance(value, ShardFiles)


def plain_state(saved: Any) -> Any:
    """``saved`` in torch's optimizer format: the shards of a sharded checkpoint consolidated, anything
    else as it is."""
    return consolidate(list(saved)) if _is_shard_files(saved) else saved


def consolidate_to_file(directory: Any, out: Any) -> int:
    """Write :func:`consolidate_checkpoint` of ``directory`` to ``out`` atomically, with the user's
    umask; returns its size in bytes."""
    checkpoint = consolidate_checkpoint(directory)
    return write_atomic(Path(out), lambda f: torch.save(checkpoint, f))
