"""``PrefetchDataModule``: shard a map-style Dataset over MPI ranks and load it in the background.

Three pieces, from the bottom up:

* :func:`shard_indices` -- the pure sharding rule: which dataset indices one rank loads in one
  epoch, which of them are padding, how they split into batches. No MPI, no threads.
* :class:`PrefetchLoader` -- an iterable over one rank's batches. Loader threads read, transform
  and collate up to ``prefetch`` batches ahead of the training step, and (on CUDA) copy them to
  the device from pinned memory on a side stream.
* :class:`PrefetchDataModule` -- the LightningDataModule users hand to ``Trainer.fit``. It takes
  rank and world size from MPI, builds one loader per stage, takes the epoch from
  ``trainer.current_epoch``, logs wait times and stops every loader thread on teardown or on an
  exception.

Why threads and not processes
-----------------------------
Theano-MPI loaded in a helper process it spawned with MPI. The Lightning answer is DataLoader
workers, which are ``fork``\\ ed from the MPI process. Neither is needed here, and both cost:

* ``fork`` after ``MPI_Init`` is unsafe on several transports (UCX, verbs and shared-memory
  segments are registered per process and get duplicated or torn down under the parent), and
  the child inherits the launcher's PMI connection.
* A spawned process has to receive the dataset (pickled, one copy per rank and worker) and
  send every batch back through a pipe or shared memory (one more copy per batch), and it must
  never import MPI itself.
* Threads share the dataset in place and make no MPI calls, so the MPI library never sees them.
  Decoding, file reads and torch tensor ops release the GIL, so they run beside the training
  step, which itself spends most of its time in torch kernels or waiting on the GPU with the
  GIL released. Pure-Python transforms hold the GIL; for those, raise ``num_threads``
  only as far as the transform releases it.

Memory is bounded: at most ``prefetch`` loaded batches wait ahead of the one the training step
holds, whatever ``num_threads`` is.
"""
from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import IterableDataset, default_collate

from lightning_mpi.data.transforms import derive_seed, sample_seed

__all__ = [
    "LoaderStats",
    "PrefetchDataModule",
    "PrefetchLoader",
    "ShardPlan",
    "epoch_order",
    "num_batches_per_rank",
    "shard_indices",
]


# --------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value: Any, minimum: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_bool(name: str, value: Any, where: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be True or False, got {value!r}")
    return bool(value)


def _check_dataset(name: str, dataset: Any, where: str) -> int:
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


# --------------------------------------------------------------------------------------------
# sharding


@dataclass(frozen=True)
class ShardPlan:
    """What one rank loads in one epoch.

    Attributes:
        indices: dataset indices in load order (``int64``).
        valid: ``False`` where the position is padding, i.e. a repeat of a sample that another
            position of the epoch already holds (only with ``drop_last=False``).
        batch_size: the batch size; the last batch may be shorter, equally on every rank.
    """

    indices: np.ndarray
    valid: np.ndarray
    batch_size: int

    @property
    def num_batches(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def batch_slice(self, k: int) -> slice:
        """Positions of batch ``k`` in :attr:`indices`."""
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {k} out of range [0, {self.num_batches})")
        return slice(k * self.batch_size, min((k + 1) * self.batch_size, len(self.indices)))


def num_batches_per_rank(num_samples: int, world_size: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches per rank per epoch; the same on every rank and in every epoch.

    ``ceil(ceil(N / W) / B)`` with ``drop_last=False``, ``floor(N / (W * B))`` with ``drop_last=True``.
    """
    n = _check_int("num_samples", num_samples, 0, "num_batches_per_rank")
    w = _check_int("world_size", world_size, 1, "num_batches_per_rank")
    b = _check_int("batch_size", batch_size, 1, "num_batches_per_rank")
    if drop_last:
        return n // (w * b)
    return math.ceil(math.ceil(n / w) / b)


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order: a permutation of ``range(num_samples)``.

    It depends only on ``(seed, epoch)``, so every rank computes the same one without
    communicating. ``shuffle=False`` gives ``0, 1, ..., N-1``.
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    # numpy's SeedSequence hashes the whole entropy list; the result is fixed across platforms
    # and numpy versions (PCG64 and its seeding are frozen by numpy's stream policy).
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def shard_indices(
    num_samples: int,
    world_size: int,
    rank: int,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> ShardPlan:
    """The indices rank ``rank`` of ``world_size`` loads in ``epoch``.

    The epoch's order (:func:`epoch_order`) is dealt round-robin: global position ``p`` goes to
    rank ``p % world_size``. The remainder is handled so that every rank gets the same number
    of batches, of the same sizes:

    * ``drop_last=False`` (pad): the order is extended cyclically to ``ceil(N / W) * W``
      positions, so fewer than ``W`` positions are padding. A padded position repeats a sample
      from the start of the epoch's order and is marked ``valid == False``. Every sample appears
      exactly once among the valid positions of all ranks together. Padding only ever sits in
      the last position of a rank, i.e. in its last batch. Each rank has ``ceil(N / W)``
      positions in ``ceil(ceil(N / W) / B)`` batches; only the last one may be shorter than ``B``.
    * ``drop_last=True`` (drop): only the first ``floor(N / (W * B)) * W * B`` positions are
      used; every batch is full and every sample appears at most once. With ``shuffle=True`` a
      different set of samples is dropped each epoch.
    """
    where = "shard_indices"
    n = _check_int("num_samples", num_samples, 1, where)
    w = _check_int("world_size", world_size, 1, where)
    b = _check_int("batch_size", batch_size, 1, where)
    r = _check_int("rank", rank, 0, where)
    if r >= w:
        raise ValueError(f"{where}: rank must be in [0, world_size - 1] = [0, {w - 1}], got {rank!r}")
    s = _check_int("seed", seed, 0, where)
    e = _check_int("epoch", epoch, 0, where)
    shuffle = _check_bool("shuffle", shuffle, where)
    drop_last = _check_bool("drop_last", drop_last, where)

    order = epoch_order(n, shuffle=shuffle, seed=s, epoch=e)
    if drop_last:
        total = (n // (w * b)) * w * b
        positions = np.arange(r, total, w, dtype=np.int64)
        return ShardPlan(indices=order[positions], valid=np.ones(len(positions), dtype=bool), batch_size=b)
    total = math.ceil(n / w) * w
    positions = np.arange(r, total, w, dtype=np.int64)
    # positions >= n wrap around to the start of the order: those are the padding
    return ShardPlan(indices=order[positions % n], valid=positions < n, batch_size=b)


# --------------------------------------------------------------------------------------------
# the background loader


@dataclass
class LoaderStats:
    """Per-batch wait times of a loader's current (or last) epoch, seen from the training loop.

    ``wait_s[k]`` is how long ``next()`` blocked for batch ``k``: 0 when the batch was ready, the
    loading time that the training step failed to hide otherwise.
    """

    stage: str
    epoch: int = -1
    wait_s: list[float] = field(default_factory=list)

    @property
    def batches(self) -> int:
        return len(self.wait_s)

    @property
    def total_wait_s(self) -> float:
        return float(sum(self.wait_s))

    @property
    def mean_wait_s(self) -> float:
        return self.total_wait_s / len(self.wait_s) if self.wait_s else 0.0

    @property
    def max_wait_s(self) -> float:
        return max(self.wait_s, default=0.0)


@dataclass
class _Ready:
    batch: Any
    event: Any  # torch.cuda.Event after a device copy on a side stream, else None


@dataclass
class _Failure:
    exc: BaseException
    thread_name: str


def _apply_transform(transform: Callable[[Any], Any], sample: Any) -> Any:
    # Same convention as torchvision datasets' ``transform``: it sees the input, not the target.
    if isinstance(sample, tuple) and sample:
        if hasattr(sample, "_fields"):  # namedtuple: keep the type
            return sample._replace(**{sample._fields[0]: transform(sample[0])})
        return (transform(sample[0]), *sample[1:])
    if isinstance(sample, list) and sample:
        return [transform(sample[0]), *sample[1:]]
    return transform(sample)


def _map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_map_tensors(fn, d) for d in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(fn, d) for d in data)
    if isinstance(data, dict):
        return type(data)((k, _map_tensors(fn, v)) for k, v in data.items())
    return data


class _Pipeline:
    """One epoch of background loading: the state shared by the loader threads and the consumer.

    It holds no reference to the iterator that owns it, so an iterator that the caller drops
    (``break`` out of a ``for`` loop) is collected and its ``__del__`` stops the threads.

    Flow control is a window, not a queue: batch ``k`` may start loading only once
    ``k < next_consume + prefetch``. Batches are handed out in order whatever thread finished
    first, at most ``prefetch`` of them are ever waiting, and batch ``next_consume`` is always
    allowed to load, so the window cannot deadlock.
    """

    def __init__(self, loader: PrefetchLoader, plan: ShardPlan, epoch: int, generation: int) -> None:
        self.loader = loader
        self.plan = plan
        self.epoch = epoch
        self.num_batches = plan.num_batches
        self.prefetch = loader.prefetch
        self.num_threads = max(1, min(loader.num_threads, self.num_batches))
        self.cond = threading.Condition()
        self.results: dict[int, _Ready | _Failure] = {}
        self.next_consume = 0
        self.stopped = False
        self.threads = [
            threading.Thread(
                target=_worker_main,
                args=(self, t),
                name=f"lightning_mpi-prefetch-{loader.name}-e{epoch}-g{generation}-t{t}",
                # daemon: a thread stuck inside a user's __getitem__ must not keep the
                # interpreter alive at exit; close() still joins them in every normal path.
                daemon=True,
            )
            for t in range(self.num_threads)
        ]

    def start(self) -> None:
        for th in self.threads:
            th.start()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.results.clear()  # drop loaded batches (and device memory) right away
            self.cond.notify_all()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        current = threading.current_thread()
        for th in self.threads:
            if th is current or th.ident is None:  # never started, or joining itself
                continue
            th.join(max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                warnings.warn(
                    f"lightning_mpi: loader thread {th.name} did not stop within {timeout:.0f}s; it is still "
                    "inside the dataset's __getitem__ or the transform and will exit when that returns",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _worker_main(pipe: _Pipeline, t: int) -> None:
    loader = pipe.loader
    stream = None
    if loader.device is not None and loader.device.type == "cuda":
        # One side stream per loader thread: copies overlap the compute stream and each other.
        stream = torch.cuda.Stream(device=loader.device)
    for k in range(t, pipe.num_batches, pipe.num_threads):
        with pipe.cond:
            while not pipe.stopped and k >= pipe.next_consume + pipe.prefetch:
                pipe.cond.wait()
            if pipe.stopped:
                return
        try:
            item: _Ready | _Failure | None = _load_batch(pipe, k, stream)
        except BaseException as exc:  # noqa: BLE001 - everything goes to the training loop
            item = _Failure(exc, threading.current_thread().name)
        if item is None:  # stopped mid-batch
            return
        with pipe.cond:
            if pipe.stopped:
                return
            pipe.results[k] = item
            pipe.cond.notify_all()
        if isinstance(item, _Failure):
            return  # the consumer stops the others when it reaches batch k


def _load_batch(pipe: _Pipeline, k: int, stream: Any) -> _Ready | None:
    loader = pipe.loader
    plan = pipe.plan
    sl = plan.batch_slice(k)
    samples = []
    for idx in plan.indices[sl]:
        if pipe.stopped:  # checked per sample so close() does not wait for a whole batch
            return None
        idx = int(idx)
        # Per-sample seed: the same augmentation for a sample in a given epoch whatever thread,
        # rank or world size loads it.
        with sample_seed(derive_seed(loader.seed, pipe.epoch, idx)):
            sample = loader.dataset[idx]
            if loader.transform is not None:
                sample = _apply_transform(loader.transform, sample)
        samples.append(sample)
    batch = loader.collate_fn(samples)
    if loader.return_mask:
        batch = (batch, torch.from_numpy(plan.valid[sl].copy()))
    event = None
    if stream is not None:
        device = loader.device
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # Pinned host memory makes the copy truly asynchronous; the caching host allocator
            # keeps the pinned block alive until the copy on this stream has completed.
            batch = _map_tensors(lambda t: t.pin_memory().to(device, non_blocking=True), batch)
            event = torch.cuda.Event()
            event.record(stream)
    return _Ready(batch, event)


class _PrefetchIterator:
    """One epoch of a :class:`PrefetchLoader`. Threads start on the first ``next()``."""

    def __init__(self, loader: PrefetchLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._pipe: _Pipeline | None = None
        self._done = False

    def __iter__(self) -> _PrefetchIterator:
        return self

    def _start(self) -> _Pipeline:
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                f"lightning_mpi: this iterator over the {loader.name} loader is stale: iter() was called on the "
                "loader again, which ends the previous epoch's iterator (one live epoch per loader)"
            )
        epoch = loader.epoch
        pipe = _Pipeline(loader, loader.plan(epoch), epoch, self._generation)
        loader._register(pipe)
        loader.stats = LoaderStats(stage=loader.name, epoch=epoch)
        self._pipe = pipe
        pipe.start()
        return pipe

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        pipe = self._pipe if self._pipe is not None else self._start()
        k = pipe.next_consume
        if k >= pipe.num_batches:
            self._finish(pipe)
            raise StopIteration
        t0 = time.perf_counter()
        with pipe.cond:
            while k not in pipe.results:
                if pipe.stopped:  # closed from outside (teardown, a newer iter())
                    self._done = True
                    raise StopIteration
                producer = pipe.threads[k % pipe.num_threads]
                if not producer.is_alive() and k not in pipe.results:
                    raise RuntimeError(f"lightning_mpi: loader thread {producer.name} died without a result")
                pipe.cond.wait(timeout=1.0)
            item = pipe.results.pop(k)
            pipe.next_consume = k + 1
            pipe.cond.notify_all()
        wait = time.perf_counter() - t0
        if isinstance(item, _Failure):
            self.close()
            exc = item.exc
            note = getattr(exc, "add_note", None)  # Python >= 3.11
            if note is not None:
                sl = pipe.plan.batch_slice(k)
                note(
                    f"[lightning_mpi] raised in loader thread {item.thread_name!r} while loading "
                    f"{self._loader.name} batch {k} of epoch {pipe.epoch} on rank {self._loader.rank} of "
                    f"{self._loader.world_size} (dataset indices {pipe.plan.indices[sl].tolist()})"
                )
            # Re-raising the original object keeps its type and its traceback, which starts in
            # the loader thread (the dataset's or transform's frame) and now continues here.
            raise exc
        loader = self._loader
        loader.stats.wait_s.append(wait)
        if loader.on_batch is not None:
            loader.on_batch(loader.name, k, wait)
        batch = item.batch
        if item.event is not None:
            current = torch.cuda.current_stream(loader.device)
            current.wait_event(item.event)
            # The tensors were allocated on the side stream; tell the allocator they are used
            # on the compute stream so their memory is not reused before the step is done.
            _map_tensors(lambda t: t.record_stream(current), batch)
        if k + 1 >= pipe.num_batches:
            # Join now rather than on the next (StopIteration) call: Lightning knows the
            # length and never asks for one batch more.
            self._finish(pipe)
        return batch

    def _finish(self, pipe: _Pipeline) -> None:
        if self._done:
            return
        self._done = True
        pipe.stop()
        pipe.join(self._loader.join_timeout)
        self._loader._unregister(pipe)
        if self._loader.on_epoch_end is not None:
            self._loader.on_epoch_end(self._loader.name, self._loader.stats)

    def close(self) -> None:
        """Stop and join this epoch's loader threads. Idempotent."""
        self._done = True
        pipe = self._pipe
        if pipe is not None:
            pipe.stop()
            pipe.join(self._loader.join_timeout)
            self._loader._unregister(pipe)

    def __del__(self) -> None:
        # Only signal: __del__ may run on any thread, at any point, so never block here.
        pipe = getattr(self, "_pipe", None)
        if pipe is not None:
            pipe.stop()


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
        self.num_samples = _check_dataset("dataset", dataset, where)
        self.dataset = dataset
        self.batch_size = _check_int("batch_size", batch_size, 1, where)
        self.world_size = _check_int("world_size", world_size, 1, where)
        self.rank = _check_int("rank", rank, 0, where)
        if self.rank >= self.world_size:
            raise ValueError(f"{where}: rank must be in [0, {self.world_size - 1}], got {rank!r}")
        self.shuffle = _check_bool("shuffle", shuffle, where)
        self.seed = _check_int("seed", seed, 0, where)
        self.drop_last = _check_bool("drop_last", drop_last, where)
        self.prefetch = _check_int("prefetch", prefetch, 1, where)
        self.num_threads = _check_int("num_threads", num_threads, 1, where)
        self.return_mask = _check_bool("return_mask", return_mask, where)
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
        self._pipes: list[_Pipeline] = []
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
        self._epoch = _check_int("epoch", epoch, 0, "PrefetchLoader.set_epoch")

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

    def __iter__(self) -> _PrefetchIterator:
        self.close()
        with self._lock:
            self._generation += 1
            return _PrefetchIterator(self, self._generation)

    def _register(self, pipe: _Pipeline) -> None:
        with self._lock:
            self._pipes.append(pipe)

    def _unregister(self, pipe: _Pipeline) -> None:
        with self._lock:
            if pipe in self._pipes:
                self._pipes.remove(pipe)

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


# --------------------------------------------------------------------------------------------
# the DataModule


def _mpi_rank_size(comm: Any) -> tuple[int, int]:
    if comm is None:
        from mpi4py import MPI  # imported here: importing initialises MPI

        comm = MPI.COMM_WORLD
    if not (hasattr(comm, "Get_rank") and hasattr(comm, "Get_size")):
        raise ValueError(
            f"PrefetchDataModule: comm must be an MPI communicator (Get_rank/Get_size) or None, got {type(comm).__name__}"
        )
    return int(comm.Get_rank()), int(comm.Get_size())


class PrefetchDataModule(pl.LightningDataModule):
    """Shard map-style datasets over MPI ranks and load them in background threads.

    Sharding. Rank and world size come from MPI (``comm``, default ``MPI.COMM_WORLD``; world
    size 1 under plain ``python``). Each epoch has one global order, a permutation drawn from
    ``(seed, epoch)`` when ``shuffle`` (train only; val and test keep dataset order), identical
    on every rank, dealt round-robin to the ranks (:func:`shard_indices`). The epoch is
    ``trainer.current_epoch``. Every rank gets the same number of batches of the same sizes, so
    a synchronous strategy never waits on a rank's extra batch. The remainder, when ``N`` is
    not a multiple of ``W * batch_size``:

    * ``drop_last=False`` (default) pads: each rank loads ``ceil(N / W)`` samples; fewer than
      ``W`` positions in the epoch are padding, which repeat samples from the start of the
      epoch's order and sit in the affected ranks' last batch (which, like every rank's last
      batch, may be shorter than ``batch_size``). Every sample is loaded exactly once outside the
      padding. With ``return_mask=True`` each batch is ``(batch, valid)``, ``valid`` a bool
      tensor that is ``False`` at padded positions, so a loss or metric can weight them 0. A
      dataset smaller than the world size still gives every rank one batch per epoch (one sample
      on 3 ranks: rank 0 holds it, ranks 1 and 2 a padded repeat of it).
    * ``drop_last=True`` drops: each rank loads ``floor(N / (W * batch_size))`` full batches;
      every sample at most once (with shuffling, a different remainder is dropped each epoch).
      Only the train loader drops; val and test always pad so that every sample is evaluated.

    Background loading. ``num_threads`` threads per loader read ``dataset[i]``, apply the
    transform and collate, at most ``prefetch`` batches ahead of the training step (threads, not
    processes: no ``fork`` of an MPI process and no copy of the dataset; see the module docs).
    When the trainer's device is CUDA and ``pin_memory`` is set, each batch is pinned and
    copied to the device on a side stream, and the training step's stream waits on that copy.

    Errors. An empty dataset (``len == 0``), or ``drop_last=True`` with fewer than
    ``W * batch_size`` train samples, raises ``ValueError`` at construction, the same on every
    rank and before any MPI communication, so no rank waits for another. An exception raised
    by the dataset, the transform or the collate function is re-raised in the training loop,
    same object and type, with its traceback from the loader thread and a note naming the
    batch, epoch, rank and indices.

    Cleanup. Loader threads stop at the end of each epoch, on early stop / ``limit_*_batches``
    (at ``teardown``), on an exception (``on_exception``), and when an abandoned epoch's
    iterator is replaced or collected. After ``fit`` no thread is left.

    Stats. ``wait_stats[stage]`` holds the per-batch wait of the stage's current or last epoch.
    With loggers attached, rank 0 logs ``prefetch/train_wait_ms`` (mean wait per batch over the
    last ``log_every_n_steps`` batches) and ``prefetch/{stage}_epoch_wait_ms`` (mean over the
    epoch) plus ``prefetch/{stage}_epoch_wait_s`` (total) at each epoch end.

    Args:
        train_dataset: map-style dataset for ``fit``.
        val_dataset: map-style dataset for validation, or ``None`` (no validation).
        test_dataset: map-style dataset for ``test``, or ``None``.
        batch_size: samples per batch on each rank (``>= 1``); the global batch is ``W`` times it.
        shuffle: reshuffle the train set every epoch.
        seed: seed (``>= 0``) of the permutation and of the per-sample transform seeds.
        drop_last: train remainder handling, see above.
        prefetch: loaded batches allowed to wait ahead of the training step (``>= 1``).
        transform: callable applied in a loader thread to each train sample's input:
            ``sample[0]`` when the dataset returns a tuple or list (``(input, target)``), the
            whole sample otherwise. The random transforms in :mod:`lightning_mpi.data.transforms` are
            seeded per ``(seed, epoch, sample index)``, so runs are reproducible.
        eval_transform: the same for val and test samples (e.g. a center crop); ``None``: none.
        num_threads: loader threads per stage (``>= 1``).
        collate_fn: list of samples to batch; default ``torch.utils.data.default_collate``.
        return_mask: yield ``(batch, valid)`` instead of ``batch``.
        pin_memory: on a CUDA device, pin batches and copy them on a side stream; no effect on CPU.
        comm: MPI communicator to shard over; default ``mpi4py.MPI.COMM_WORLD``.
    """

    def __init__(
        self,
        train_dataset: Any,
        val_dataset: Any = None,
        test_dataset: Any = None,
        batch_size: int = 32,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: int = 2,
        transform: Callable[[Any], Any] | None = None,
        *,
        eval_transform: Callable[[Any], Any] | None = None,
        num_threads: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        return_mask: bool = False,
        pin_memory: bool = True,
        comm: Any = None,
    ) -> None:
        super().__init__()
        where = "PrefetchDataModule"
        self.batch_size = _check_int("batch_size", batch_size, 1, where)
        self.shuffle = _check_bool("shuffle", shuffle, where)
        self.seed = _check_int("seed", seed, 0, where)
        self.drop_last = _check_bool("drop_last", drop_last, where)
        self.prefetch = _check_int("prefetch", prefetch, 1, where)
        self.num_threads = _check_int("num_threads", num_threads, 1, where)
        self.return_mask = _check_bool("return_mask", return_mask, where)
        self.pin_memory = _check_bool("pin_memory", pin_memory, where)
        for name, fn in (("transform", transform), ("eval_transform", eval_transform), ("collate_fn", collate_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{where}: {name} must be callable or None, got {type(fn).__name__}")
        self.transform = transform
        self.eval_transform = eval_transform
        self.collate_fn = collate_fn
        self.rank, self.world_size = _mpi_rank_size(comm)

        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.test_dataset = test_dataset
        n_train = _check_dataset("train_dataset", train_dataset, where)
        if val_dataset is not None:
            _check_dataset("val_dataset", val_dataset, where)
        if test_dataset is not None:
            _check_dataset("test_dataset", test_dataset, where)
        if self.drop_last and n_train < self.world_size * self.batch_size:
            raise ValueError(
                f"{where}: drop_last=True leaves no train batch: len(train_dataset) = {n_train} < world_size * "
                f"batch_size = {self.world_size} * {self.batch_size}; lower batch_size or set drop_last=False"
            )

        self._loaders: dict[str, PrefetchLoader] = {}
        self.wait_stats: dict[str, LoaderStats] = {}
        self._window: list[float] = []

    # ---- Lightning hooks ------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is not None and trainer.world_size != self.world_size:
            raise RuntimeError(
                f"PrefetchDataModule shards over an MPI communicator of size {self.world_size}, but the trainer "
                f"runs {trainer.world_size} processes. Launch with `mpiexec -n {trainer.world_size}` and an mpi_* "
                "strategy, or pass the communicator the strategy trains on as `comm=`."
            )

    def train_dataloader(self) -> PrefetchLoader:
        return self._loader("train", self.train_dataset, self.shuffle, self.drop_last, self.transform)

    def val_dataloader(self) -> PrefetchLoader | list:
        if self.val_dataset is None:
            return []  # Lightning runs no validation for an empty collection
        return self._loader("val", self.val_dataset, False, False, self.eval_transform)

    def test_dataloader(self) -> PrefetchLoader:
        if self.test_dataset is None:
            raise ValueError("PrefetchDataModule: test_dataloader needs a test_dataset, got None")
        return self._loader("test", self.test_dataset, False, False, self.eval_transform)

    def teardown(self, stage: str) -> None:
        self.close()

    def on_exception(self, exception: BaseException) -> None:
        # Lightning does not call teardown hooks when fit fails, only on_exception.
        self.close()

    def close(self) -> None:
        """Stop and join every loader thread of every stage. Idempotent."""
        for loader in list(self._loaders.values()):
            loader.close()

    @property
    def loaders(self) -> dict[str, PrefetchLoader]:
        """The loaders built so far, by stage."""
        return dict(self._loaders)

    # ---- internals -------------------------------------------------------------------------

    def _device(self) -> torch.device | None:
        if not self.pin_memory or self.trainer is None:
            return None
        try:
            device = self.trainer.strategy.root_device
        except Exception:  # noqa: BLE001 - a strategy without a device yet: let Lightning copy
            return None
        return device if device.type == "cuda" else None

    def _epoch(self) -> int | None:
        return self.trainer.current_epoch if self.trainer is not None else None

    def _loader(self, stage: str, dataset: Any, shuffle: bool, drop_last: bool, transform: Any) -> PrefetchLoader:
        old = self._loaders.pop(stage, None)
        if old is not None:
            old.close()
        loader = PrefetchLoader(
            dataset,
            batch_size=self.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=drop_last,
            prefetch=self.prefetch,
            num_threads=self.num_threads,
            transform=transform,
            collate_fn=self.collate_fn,
            return_mask=self.return_mask,
            device=self._device(),
            epoch_fn=self._epoch,
            name=stage,
            on_batch=self._on_batch,
            on_epoch_end=self._on_epoch_end,
        )
        self._loaders[stage] = loader
        return loader

    def _log(self, metrics: dict[str, float]) -> None:
        trainer = self.trainer
        if trainer is None or trainer.sanity_checking or not trainer.loggers:
            return
        for logger in trainer.loggers:  # rank-zero-only inside each logger
            logger.log_metrics(metrics, step=trainer.global_step)

    def _on_batch(self, stage: str, k: int, wait_s: float) -> None:
        loader = self._loaders.get(stage)
        if loader is not None:
            self.wait_stats[stage] = loader.stats  # a fresh LoaderStats each epoch
        if stage != "train" or self.trainer is None:
            return
        self._window.append(wait_s)
        if len(self._window) >= max(1, self.trainer.log_every_n_steps):
            self._log({"prefetch/train_wait_ms": 1000.0 * sum(self._window) / len(self._window)})
            self._window.clear()

    def _on_epoch_end(self, stage: str, stats: LoaderStats) -> None:
        self.wait_stats[stage] = stats
        if stats.batches:
            self._log(
                {
                    f"prefetch/{stage}_epoch_wait_ms": 1000.0 * stats.mean_wait_s,
                    f"prefetch/{stage}_epoch_wait_s": stats.total_wait_s,
                }
            )
