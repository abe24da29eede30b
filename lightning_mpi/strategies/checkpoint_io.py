"""Checkpoint files that are either complete or absent, with the permissions a plain write gives.

A job killed while writing (a node failure, a time limit, SIGKILL) must not leave a truncated
checkpoint where the last good one was. :class:`AtomicWriteMixin` writes to a temporary file in the
same directory, flushes it to disk, then renames it over the target: ``os.replace`` is atomic on
POSIX file systems, so readers see the old file or the new one, never half of one.

The temporary file is created the way ``open(path, "wb")`` creates a file (mode ``0o666``, less the
process umask and whatever default ACL the directory carries), not the way ``tempfile.mkstemp``
does (``0o600``): on a shared cluster a teammate's evaluation job must be able to read the
checkpoints, as it can read plain Lightning's. When the target exists, the new file keeps its mode,
as an overwrite by ``open`` would.

:mod:`lightning_mpi.strategies.build` puts the mixin on the ``TorchCheckpointIO`` of each Fabric
package as ``AtomicCheckpointIO``; Trainer and Fabric saves both go through it.

Under ``heal="shrink"`` a save is one healing operation (:func:`save_through_heals`): the rule's
state, rank 0's write and a barrier. A rank lost anywhere in it (rank 0 in the middle of its write
included) makes the survivors heal and save again, the new rank 0 writing; until then the
previous file is intact (the atomic write), and the lost writer's temporary file is removed.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_mpi.checkpoint.sharded import is_sharded_checkpoint, load_sharded

#: ``os.open`` flags of a new file written once: fail rather than reuse a name, no leak into children.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _temporary_name(target: Path) -> re.Pattern[str]:
    """The names :func:`create_temporary_beside` gives ``target``'s temporary files."""
    return re.compile(rf"\.{re.escape(target.name)}\.[0-9a-f]{{12}}\.tmp")


def remove_stale_temporaries(target: Any) -> list[Path]:
    """Remove the temporary files beside ``target`` that an atomic write of it left when its writer
    died before the rename (only names :func:`create_temporary_beside` makes for ``target``); call
    it only where no other process writes ``target`` now. Returns what was removed."""
    path = Path(str(target))
    pattern = _temporary_name(path)
    removed: list[Path] = []
    try:
        candidates = list(path.parent.iterdir())
    except OSError:  # no such local directory (or a remote store): nothing left here
        return removed
    for candidate in candidates:
        if pattern.fullmatch(candidate.name):
            try:
                candidate.unlink()
            except FileNotFoundError:
                continue
            removed.append(candidate)
    return removed


def save_through_heals(
    healing: Any, save: Callable[[], None], barrier: Callable[[], None], target: Any, writes: Callable[[], bool]
) -> None:
    """A checkpoint save that a rank lost on the way cannot leave undone (``heal="shrink"``).

    ``save()`` is the strategy's whole save on this rank (the rule's state, gathered where it is
    sharded, and rank 0's write); with ``healing`` active it runs with ``barrier()`` after it as one
    :meth:`~.healing.RunHealing.operation`: a loss anywhere in it, rank 0 dying in its write
    included, makes the survivors heal and run it again (the new rank 0 writes, after removing the
    temporary file the lost writer left; ``writes()``: this rank writes ``target`` now). A
    survivor that completed the barrier knows that the file was written (every rank had entered
    it, the writer after its write), so one that missed that completion takes nothing and goes
    on. Without ``healing``: ``save()`` alone, as before. A side of the run that stopped for want of
    ``min_ranks`` saves nothing (:meth:`~.healing.RunHealing.refuse_saves`).
    """
    if not healing.active:
        save()
        return
    healing.refuse_saves(target)
    attempts = itertools.count()

    def run() -> None:
        # a redo after a heal: a lost writer may have left its temporary file (only the writer
        # looks, before it makes its own, so that nobody removes the one being written)
        if next(attempts) and writes():
            remove_stale_temporaries(target)
        save()
        barrier()

    healing.operation("the checkpoint save", run, keep=lambda result: None)


def create_temporary_beside(target: Path, attempts: int = 100) -> tuple[int, Path]:
    """Create and open (write-only) a new, uniquely named hidden file in ``target``'s directory.

    Returns the file descriptor and the path. The file gets the mode a plain ``open(target, "wb")``
    would leave: the existing target's mode if there is one, else ``0o666`` filtered by the umask
    (the kernel applies it, so no thread ever changes the process umask to read it).
    """
    try:
        existing_mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        existing_mode = None
    for _ in range(attempts):
        candidate = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(candidate, _CREATE_FLAGS, 0o666)
        except FileExistsError:
            continue
        if existing_mode is not None:
            try:
                os.fchmod(fd, existing_mode)
            except BaseException:
                os.close(fd)
                os.unlink(candidate)
                raise
        return fd, candidate
    raise FileExistsError(f"could not create a temporary file beside {target} after {attempts} attempts")


class AtomicWriteMixin:
    """``TorchCheckpointIO`` with write-to-temporary-then-rename for local paths.

    ``get_filesystem`` is the Fabric package's own (a staticmethod set by the class builder).
    """

    get_filesystem: Any

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"storage_options={storage_options!r} is not supported by AtomicCheckpointIO; "
                "pass a custom CheckpointIO plugin to use it"
            )
        fs = self.get_filesystem(path)
        if fs.protocol not in ("file", ("file", "local")) and "file" not in fs.protocol:
            super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[misc]  # remote stores: no rename
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = create_temporary_beside(target)
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """A checkpoint file as Lightning reads it, or a sharded checkpoint directory
        (``mpi_zero``'s) with each optimizer shard slot holding all ranks' shards, read lazily."""
        if is_sharded_checkpoint(path):
            return load_sharded(path, weights_only=bool(weights_only))
        kwargs = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=weights_only, **kwargs)  # type: ignore[misc]  # TorchCheckpointIO's
