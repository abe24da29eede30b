"""``PrefetchLoader``: an iterable over one rank's batches, loaded by background threads.

It holds the loading configuration and runs one :class:`~lightning_mpi.data.pipeline.Pipeline`
per epoch (threads, not processes: see :mod:`lightning_mpi.data.pipeline`); which indices it
loads comes from :func:`~lightning_mpi.data.sharding.shard_indices`. :class:`PrefetchIterator`
(what ``iter(loader)`` returns) hands one epoch's batches out in order, records their wait in
:class:`~lightning_mpi.data.pipeline.LoaderStats` and re-raises a loader thread's exception in the
training loop. It reaches the loader only through :meth:`PrefetchLoader.open_epoch`,
:meth:`PrefetchLoader.close_epoch` and :meth:`PrefetchLoader.batch_delivered`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from lightning_mpi.data.checks import check_bool, check_dataset, check_int
from lightning_mpi.data.pipeline import LoaderStats, LoadFailure, LoadSpec, Pipeline
from lightning_mpi.data.sharding import ShardPlan, num_batches_per_rank, shard_indices

__all__ = ["PrefetchIterator", "PrefetchLoader"]


class PrefetchLoader:
    """An iterable over one rank's batches, loaded by background threads.

    It is deliberately not a ``torch.utils.data.DataLoader``: Lightning's sampler injection
    (``use_distributed_sampler``) only rewrites DataLoaders, so it cannot shard this loader a
    second time.

    Args:
        dataset: map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: samples per batch (``>= 1``).
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of ranks sharing the dataset (``>= 1``).
        shuffle: draw a new permutation each epoch from ``(seed, epoch)``.
        seed: base seed (``>= 0``) of the permutation and of per-sample transform seeds.
        drop_last: remainder handling, see :func:`shard_indices`.
        prefetch: most loaded batches waiting ahead of the training step (``>= 1``).
        num_threads: loader threads (``>= 1``).
        transform: callable applied to each sample's input in a loader thread, see
            :class:`PrefetchDataModule`.
        collate_fn: turns a list of samples into a batch (default ``default_collate``).
        return_mask: yield ``(batch, valid)`` with a bool tensor ``valid`` that is ``False`` at
            padded positions.
        device: when a CUDA device, batches are pinned and copied there on a side stream.
        epoch_fn: returns the current epoch, or ``None`` to fall back to :meth:`set_epoch`.
        name: stage name used in thread names, stats and error notes.
        on_batch: ``on_batch(name, k, wait_s)`` after each batch is handed out.
        on_epoch_end: ``on_epoch_end(name, stats)`` after the last batch of an epoch.
        join_timeout: seconds to wait for threads when closing before warning.

    ``iter()`` is cheap: threads start on the first ``next()``, and the epoch is read then. A new
    ``iter()`` stops the previous epoch's threads (one live epoch per loader). An iterator that
    is dropped early stops its threads when collected; :meth:`close` stops everything now.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 2,
        num_threads: int = 1,
        transform: Callable[[Any], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        return_mask: bool = False,
        device: torch.device | str | None = None,
        epoch_fn: Callable[[], int | None] | None = None,
        name: str = "train",
        on_batch: Callable[[str, int, float], None] | None = None,
        on_epoch_end: Callable[[str, LoaderStats], None] | None = None,
        join_timeout: float = 30.0,
    ) -> None:
        where = "PrefetchLoader"
        self.num_samples = check_dataset("dataset", dataset, where)
        self.dataset = dataset
        self.batch_size = check_int("batch_size", batch_size, 1, where)
        self.world_size = check_int("world_size", world_size, 1, where)
        self.rank = check_int("rank", rank, 0, where)
        if self.rank >= self.world_size:
            raise ValueError(f"{where}: rank must be in [0, {self.world_size - 1}], got {rank!r}")
        self.shuffle = check_bool("shuffle", shuffle, where)
        self.seed = check_int("seed", seed, 0, where)
        self.drop_last = check_bool("drop_last", drop_last, where)
        self.prefetch = check_int("prefetch", prefetch, 1, where)
        self.num_threads = check_int("num_threads", num_threads, 1, where)
        self.return_mask = check_bool("return_mask", return_mask, where)
        if transform is not None and not callable(transform):
            raise ValueError(f"{where}: transform must be callable or None, got {type(transform).__name__}")
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"{where}: collate_fn must be callable or None, got {type(collate_fn).__name__}")
        if not (isinstance(join_timeout, (int, float)) and join_timeout > 0):
            raise ValueError(f"{where}: join_timeout must be a number > 0, got {join_timeout!r}")
        self.transform = transform
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.device = torch.device(device) if device is not None else None
        self.epoch_fn = epoch_fn
        self.name = name
        self.on_batch = on_batch
        self.on_epoch_end = on_epoch_end
        self.join_timeout = float(join_timeout)
        self.stats = LoaderStats(stage=name)
        self._epoch = 0
        self._generation = 0
        self._pipes: list[Pipeline] = []
        self._lock = threading.Lock()
        self._length = num_batches_per_rank(self.num_samples, self.world_size, self.batch_size, self.drop_last)
        if self._length == 0:
            raise ValueError(
                f"{where}: drop_last=True leaves no batch: {self.num_samples} samples < world_size * batch_size = "
                f"{self.world_size} * {self.batch_size}; lower batch_size or set drop_last=False"
            )

    def __len__(self) -> int:
        return self._length

    def set_epoch(self, epoch: int) -> None:
        """Epoch used when no ``epoch_fn`` is given (or it returns ``None``)."""
        self._epoch = check_int("epoch", epoch, 0, "PrefetchLoader.set_epoch")

    @property
    def epoch(self) -> int:
        if self.epoch_fn is not None:
            e = self.epoch_fn()
            if e is not None:
                return int(e)
        return self._epoch

    def plan(self, epoch: int | None = None) -> ShardPlan:
        """This rank's :class:`ShardPlan` for ``epoch`` (default: the current epoch)."""
        return shard_indices(
            self.num_samples,
            self.world_size,
            self.rank,
            self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
            drop_last=self.drop_last,
        )

    def __iter__(self) -> PrefetchIterator:
        self.close()
        with self._lock:
            self._generation += 1
            return PrefetchIterator(self, self._generation)

    # -- what an iterator calls ----------------------------------------------------------------
    def open_epoch(self, generation: int) -> Pipeline:
        """Start the epoch of the iterator made by the ``generation``-th ``iter()``: its pipeline
        (threads running) over :meth:`plan` of the current epoch, kept until :meth:`close_epoch`
        or :meth:`close`; :attr:`stats` starts afresh. Raises ``RuntimeError`` when a newer
        ``iter()`` has made that iterator stale (one live epoch per loader)."""
        with self._lock:
            if generation != self._generation:
                raise RuntimeError(
                    f"lightning_mpi: this iterator over the {self.name} loader is stale: iter() was called on the "
                    "loader again, which ends the previous epoch's iterator (one live epoch per loader)"
                )
        epoch = self.epoch
        spec = LoadSpec(
            dataset=self.dataset,
            collate_fn=self.collate_fn,
            name=self.name,
            seed=self.seed,
            prefetch=self.prefetch,
            num_threads=self.num_threads,
            transform=self.transform,
            return_mask=self.return_mask,
            device=self.device,
        )
        pipe = Pipeline(spec, self.plan(epoch), epoch, tag=f"-g{generation}")
        with self._lock:
            self._pipes.append(pipe)
        self.stats = LoaderStats(stage=self.name, epoch=epoch)
        pipe.start()
        return pipe

    def batch_delivered(self, k: int, wait_s: float) -> None:
        """Batch ``k`` of the current epoch was handed out after waiting ``wait_s`` seconds."""
        self.stats.wait_s.append(wait_s)
        if self.on_batch is not None:
            self.on_batch(self.name, k, wait_s)

    def close_epoch(self, pipe: Pipeline, finished: bool) -> None:
        """Stop and join ``pipe``'s threads and forget it; ``finished`` (every batch handed out)
        also reports the epoch's stats to ``on_epoch_end``."""
        pipe.stop()
        pipe.join(self.join_timeout)
        with self._lock:
            if pipe in self._pipes:
                self._pipes.remove(pipe)
        if finished and self.on_epoch_end is not None:
            self.on_epoch_end(self.name, self.stats)

    def close(self) -> None:
        """Stop and join every loader thread of this loader. Idempotent."""
        with self._lock:
            pipes, self._pipes = self._pipes, []
        for pipe in pipes:
            pipe.stop()
        for pipe in pipes:
            pipe.join(self.join_timeout)

    @property
    def live_threads(self) -> list[threading.Thread]:
        """Loader threads still running (for tests and debugging)."""
        with self._lock:
            return [th for pipe in self._pipes for th in pipe.threads if th.is_alive()]

    def __repr__(self) -> str:
        return (
            f"PrefetchLoader(name={self.name!r}, samples={self.num_samples}, batches={self._length}, "
            f"batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, prefetch={self.prefetch}, "
            f"num_threads={self.num_threads})"
        )


class PrefetchIterator:
    """One epoch of a :class:`PrefetchLoader`. Threads start on the first ``next()``."""

    def __init__(self, loader: PrefetchLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._pipe: Pipeline | None = None
        self._done = False

    def __iter__(self) -> PrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._pipe is None:
            self._pipe = self._loader.open_epoch(self._generation)
        pipe = self._pipe
        k = pipe.next_consume
        if k >= pipe.num_batches:
            self._finish(pipe)
            raise StopIteration
        t0 = time.perf_counter()
        item = pipe.take(k)
        if item is None:  # closed from outside (teardown, a newer iter())
            self._done = True
            raise StopIteration
        wait = time.perf_counter() - t0
        if isinstance(item, LoadFailure):
            self.close()
            raise self._with_note(item, pipe, k)
        self._loader.batch_delivered(k, wait)
        batch = item.for_current_stream(self._loader.device)
        if k + 1 >= pipe.num_batches:
            # Join now rather than on the next (StopIteration) call: Lightning knows the
            # length and never asks for one batch more.
            self._finish(pipe)
        return batch

    def _with_note(self, failure: LoadFailure, pipe: Pipeline, k: int) -> BaseException:
        """The loader thread's exception, with a note on where it was raised (Python >= 3.11).

        Re-raising the original object keeps its type and its traceback, which starts in the
        loader thread (the dataset's or transform's frame) and continues in the training loop."""
        exc = failure.exc
        note = getattr(exc, "add_note", None)
        if note is not None:
            loader = self._loader
            note(
                f"[lightning_mpi] raised in loader thread {failure.thread_name!r} while loading "
                f"{loader.name} batch {k} of epoch {pipe.epoch} on rank {loader.rank} of "
                f"{loader.world_size} (dataset indices {pipe.plan.indices[pipe.plan.batch_slice(k)].tolist()})"
            )
        return exc

    def _finish(self, pipe: Pipeline) -> None:
        if self._done:
            return
        self._done = True
        self._loader.close_epoch(pipe, finished=True)

    def close(self) -> None:
        """Stop and join this epoch's loader threads. Idempotent."""
        self._done = True
        if self._pipe is not None:
            self._loader.close_epoch(self._pipe, finished=False)

    def __del__(self) -> None:
        # Only signal: __del__ may run on any thread, at any point, so never block here.
        pipe = getattr(self, "_pipe", None)
        if pipe is not None:
            pipe.stop()
