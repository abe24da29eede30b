"""Files and directories that appear whole or not at all, with the permissions of a plain ``open``.

A checkpoint killed halfway (a node failure, a time limit, SIGKILL) must not leave a truncated
file where the last good one was, and it must be readable like any file the user writes:
``tempfile.mkstemp``/``mkdtemp`` create 0600/0700 entries whatever the umask, so the names here
are made with ``open(..., "xb")`` and ``os.mkdir``, which apply the umask (0644/0755 under the
usual 022), under a hidden temporary name in the same directory, then renamed into place.

A directory cannot be renamed over a non-empty one, so :func:`publish_dir` moves the previous
checkpoint aside first (``.NAME.old-XXXX``), renames the new one into place and deletes the old
one. A crash between those two renames leaves the previous checkpoint under its hidden name;
:func:`resolve_dir` finds it there.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def hidden_sibling(target: Path, tag: str) -> Path:
    """``DIR/.NAME.tag-<random>`` beside ``target``: a temporary or old name on the same file system."""
    return target.parent / f".{target.name}.{tag}-{uuid.uuid4().hex[:12]}"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, write: Callable[[IO[bytes]], Any]) -> int:
    """Create ``path`` (it must not exist), fill it with ``write(handle)``, flush it to disk; return
    its size. The file gets ``0666 & ~umask``, like any file the user writes."""
    with open(path, "xb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
        return handle.tell()


def write_atomic(target: Path, write: Callable[[IO[bytes]], Any]) -> int:
    """Write ``target`` through a hidden temporary file in its directory, renamed over it when
    complete (readers see the old file or the new one). Returns the size written."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(target, "tmp")
    try:
        size = write_new_file(tmp, write)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)
    return size


def make_staging_dir(target: Path) -> Path:
    """A new hidden directory beside ``target`` (``0777 & ~umask``) to build it in."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = hidden_sibling(target, "tmp")
    os.mkdir(staging)
    return staging


def publish_dir(staging: Path, target: Path) -> None:
    """Move the complete ``staging`` directory to ``target``, replacing what was there."""
    fsync_path(staging)
    old = None
    if target.exists() or target.is_symlink():
        old = hidden_sibling(target, "old")
        os.rename(target, old)
    os.rename(staging, target)
    fsync_path(target.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def resolve_dir(target: Path, complete: Callable[[Path], bool]) -> Path | None:
    """``target`` if ``complete(target)``; else a previous copy that :func:`publish_dir` left aside
    when it was interrupted (the newest complete ``.NAME.old-*``); else ``None``."""
    target = Path(target)
    if complete(target):
        return target
    if not target.parent.is_dir():
        return None
    olds = [p for p in target.parent.glob(f".{target.name}.old-*") if complete(p)]
    return max(olds, key=lambda p: p.stat().st_mtime) if olds else None


def remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
