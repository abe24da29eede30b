"""Checkpoint files that are either complete or absent.

A job killed while writing (a node failure, a time limit, SIGKILL) must not leave a truncated
checkpoint where the last good one was. :class:`AtomicWriteMixin` writes to a temporary file in the
same directory, flushes it to disk, then renames it over the target: ``os.replace`` is atomic on
POSIX file systems, so readers see the old file or the new one, never half of one.
:mod:`lightning_mpi.strategies.build` puts it on the ``TorchCheckpointIO`` of each Fabric package
as ``AtomicCheckpointIO``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


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
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
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
