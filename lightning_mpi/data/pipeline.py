"""One epoch of background loading: loader threads produce batches, an iterator hands them out.

:class:`Pipeline` is the state that one epoch's loader threads and its consumer share. Each
thread reads samples, applies the transform under the sample's seed, collates, and on CUDA
copies the batch to the device from pinned memory on a side stream.
:class:`PrefetchIterator` is the consumer (what ``iter(PrefetchLoader)`` returns): it hands the
batches out in order, records their wait in :class:`LoaderStats` and re-raises a thread's
exception in the training loop.

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

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_mpi.data.sharding import ShardPlan
from lightning_mpi.data.transforms import derive_seed, sample_seed

if TYPE_CHECKING:
    from lightning_mpi.data.loader import PrefetchLoader

__all__ = ["LoaderStats", "Pipeline", "PrefetchIterator"]


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


class Pipeline:
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


def _worker_main(pipe: Pipeline, t: int) -> None:
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


def _load_batch(pipe: Pipeline, k: int, stream: Any) -> _Ready | None:
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


class PrefetchIterator:
    """One epoch of a :class:`PrefetchLoader`. Threads start on the first ``next()``."""

    def __init__(self, loader: PrefetchLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        self._pipe: Pipeline | None = None
        self._done = False

    def __iter__(self) -> PrefetchIterator:
        return self

    def _start(self) -> Pipeline:
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                f"lightning_mpi: this iterator over the {loader.name} loader is stale: iter() was called on the "
                "loader again, which ends the previous epoch's iterator (one live epoch per loader)"
            )
        epoch = loader.epoch
        pipe = Pipeline(loader, loader.plan(epoch), epoch, self._generation)
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

    def _finish(self, pipe: Pipeline) -> None:
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
