"""Resuming a relaunched run from the newest checkpoint every rank can read.

When ``lightning-mpi --max-restarts`` relaunches a failed job it exports ``LIGHTNING_MPI_RESTART=k``
(``--resume`` exports ``LIGHTNING_MPI_RESUME=1``; a Slurm requeue sets ``SLURM_RESTART_COUNT``).
Then every ``trainer.fit(model)`` called without ``ckpt_path`` resumes by itself:

1. each rank lists the ``*.ckpt`` files it can read in the directories of the Trainer's
   ``ModelCheckpoint`` callbacks (their ``dirpath``; without one, every version directory of the
   first logger, or ``<default_root_dir>/checkpoints``);
2. the lists are all-gathered, and the newest file (by modification time) that every rank can read
   with the same size is chosen -- the same choice on every rank;
3. ``fit`` runs with ``ckpt_path=<that file>``; no file found: it starts from the beginning.

The hook is the strategy's Lightning *launcher*: ``Trainer.fit`` hands the call to
``strategy.launcher.launch(fit_impl, *args, ...)`` before it resolves ``ckpt_path`` (in
``pytorch_lightning`` and ``lightning.pytorch`` alike); :class:`AutoResume` fills in the argument
there and launches nothing (mpiexec started the processes). A ``ckpt_path`` passed to ``fit``, or
set with ``trainer.ckpt_path = ...``, always wins. ``validate``/``test``/``predict`` are untouched.
"""

from __future__ import annotations

import glob
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_mpi.checkpoint.sharded import MANIFEST, is_sharded_checkpoint
from lightning_mpi.launcher.restarts import RESTART_ENV, RESUME_ENV

__all__ = [
    "AutoResume",
    "checkpoint_dirs",
    "newest_common",
    "readable_checkpoints",
    "resume_checkpoint",
    "resume_reason",
]

#: One rank's view of one checkpoint file: (absolute path, size in bytes, modification time in ns).
Listing = tuple[str, int, int]


def resume_reason(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this run should resume (``"restart 2"``, ...), or ``None`` for a fresh run."""
    restart = environ.get(RESTART_ENV, "")
    if restart.isdigit() and int(restart) > 0:
        return f"restart {int(restart)}"
    if environ.get(RESUME_ENV, "") not in ("", "0"):
        return "--resume"
    requeue = environ.get("SLURM_RESTART_COUNT", "")
    if requeue.isdigit() and int(requeue) > 0:
        return f"Slurm requeue {int(requeue)}"
    return None


def checkpoint_dirs(trainer: Any) -> list[str]:
    """The directories the Trainer's checkpoint callbacks write to (see the module docstring).

    Before ``fit`` sets them up, a ``ModelCheckpoint`` without ``dirpath`` has no directory yet:
    Lightning will put it under the first logger's *next* version, so every version is searched.
    """
    dirs: list[str] = []
    for callback in getattr(trainer, "checkpoint_callbacks", []):
        dirpath = getattr(callback, "dirpath", None)
        if dirpath:
            dirs.append(str(dirpath))
        elif trainer.loggers:
            logger = trainer.loggers[0]
            root = os.path.join(str(logger.save_dir or trainer.default_root_dir), str(logger.name))
            dirs.extend(sorted(glob.glob(os.path.join(glob.escape(root), "*", "checkpoints"))))
        else:
            dirs.append(os.path.join(str(trainer.default_root_dir), "checkpoints"))
    if not dirs:
        dirs.append(os.path.join(str(trainer.default_root_dir), "checkpoints"))
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs))


def readable_checkpoints(dirs: Sequence[str]) -> list[Listing]:
    """The non-empty ``*.ckpt`` files in ``dirs`` that this process can open and read, and the
    complete sharded checkpoints (``mpi_zero``'s directories) whose manifest it can read."""
    found: list[Listing] = []
    for directory in dirs:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if not name.endswith(".ckpt"):
                continue
            # a sharded checkpoint is its manifest: written last, so its presence means complete
            probe = os.path.join(path, MANIFEST) if os.path.isdir(path) and is_sharded_checkpoint(path) else path
            if not os.path.isfile(probe):
                continue
            try:
                with open(probe, "rb") as handle:  # readable, not just listed
                    handle.read(1)
                stat = os.stat(probe)
            except OSError:
                continue
            if stat.st_size > 0:
                found.append((os.path.abspath(path), stat.st_size, stat.st_mtime_ns))
    return found


def newest_common(listings: Sequence[Sequence[Listing]]) -> str | None:
    """The newest checkpoint that every rank listed with the same size, or ``None``.

    ``listings[r]`` is rank r's :func:`readable_checkpoints`. Newest means the latest modification
    time any rank saw (a shared file system reports the same), ties broken by the path, so every
    rank picks the same file.
    """
    if not listings:
        return None
    sizes: dict[str, set[int]] = {}
    newest: dict[str, int] = {}
    counts: dict[str, int] = {}
    for listing in listings:
        for path in {p for p, _, _ in listing}:
            counts[path] = counts.get(path, 0) + 1
        for path, size, mtime in listing:
            sizes.setdefault(path, set()).add(size)
            newest[path] = max(newest.get(path, mtime), mtime)
    common = [p for p, n in counts.items() if n == len(listings) and len(sizes[p]) == 1]
    if not common:
        return None
    return max(common, key=lambda p: (newest[p], p))


class AutoResume:
    """The strategy's Lightning launcher: resumes ``fit`` on a restart (module docstring).

    Args:
        inner: the frontend's own launcher, which runs the call inside the failure propagation
            scope; the checkpoint is chosen inside that scope, so that a rank failing while the
            ranks agree on it fails every rank instead of leaving them waiting.
        fitting: the Trainer package's ``TrainerFn.FITTING``.
        choose: ``choose(trainer, reason)`` returns the checkpoint to resume from (collective), or None.
        forced: returns a reason to resume that overrides a ``ckpt_path`` given to ``fit`` (a
            replacement of ``heal="replace"`` resumes from the survivors' state), or None.
    """

    is_interactive_compatible = True

    def __init__(
        self,
        inner: Any,
        fitting: Any,
        choose: Callable[[Any, str], str | None],
        forced: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.inner = inner
        self.fitting = fitting
        self.choose = choose
        self.forced = forced

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        forced = self.forced() if trainer is not None and trainer.state.fn == self.fitting else None
        reason = forced or resume_reason()
        if trainer is None or reason is None or trainer.state.fn != self.fitting:
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)
        call = inspect.signature(function).bind(*args, **kwargs)
        user_managed = getattr(getattr(trainer, "_checkpoint_connector", None), "_user_managed", False)
        given = call.arguments.get("ckpt_path") is not None or user_managed
        if "ckpt_path" not in call.signature.parameters or (given and forced is None):
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)

        def resumed() -> Any:
            path = self.choose(trainer, reason)
            if path is not None:
                call.arguments["ckpt_path"] = path
            return function(*call.args, **call.kwargs)

        return self.inner.launch(resumed, trainer=trainer)

    def kill(self, signum: int) -> None:
        """Lightning asks its launcher to stop the processes it started; mpiexec started ours."""


def resume_checkpoint(trainer: Any, transport: Any, rank: int, world_size: int, reason: str) -> str | None:
    """The newest checkpoint every rank can read, the same on every rank (collective); rank 0 says
    which, and why."""
    dirs = checkpoint_dirs(trainer)
    mine = readable_checkpoints(dirs)
    listings = transport.allgather_object(mine) if world_size > 1 else [mine]
    path = newest_common(listings)
    if rank == 0:
        where = ", ".join(dirs)
        if path is None:
            message = f"no checkpoint that all {world_size} ranks can read in {where}; starting from the beginning"
        else:
            message = f"resuming from {path}, the newest checkpoint all {world_size} ranks can read"
        sys.stderr.write(f"lightning_mpi: {reason}: {message}\n")
        sys.stderr.flush()
    return path
