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
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

import torch

from lightning_mpi.checkpoint.sharded import is_sharded_checkpoint, load_sharded

#: ``os.open`` flags of a new file written once: fail rather than reuse a name, no leak into children.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


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
