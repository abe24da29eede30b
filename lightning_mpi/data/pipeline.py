"""One epoch of background loading: loader threads produce batches, in order, for one consumer.

:class:`Pipeline` is the state that one epoch's loader threads and its consumer share. Each
thread reads samples, applies the transform under the sample's seed, collates, and on CUDA
copies the batch to the device from pinned memory on a side stream. What the threads load comes
from a :class:`LoadSpec` and a :class:`~lightning_mpi.data.sharding.ShardPlan`; the consumer
(:class:`~lightning_mpi.data.loader.PrefetchIterator`) takes batch ``k`` with :meth:`Pipeline.take`.
This module knows nothing of the loader that builds the pipelines.

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
from typing import Any

import torch

from lightning_mpi.data.sharding import ShardPlan
from lightning_mpi.data.transforms import derive_seed, sample_seed

__all__ = ["LoadFailure", "LoadSpec", "LoadedBatch", "LoaderStats", "Pipeline"]


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


@dataclass(frozen=True)
class LoadSpec:
    """What the loader threads of one epoch read: how to load, transform and collate a batch.

    Args:
        dataset: map-style dataset (``__getitem__``).
        collate_fn: turns a list of samples into a batch.
        name: stage name, for thread names.
        seed: base of the per-sample transform seeds.
        prefetch: most loaded batches waiting ahead of the consumer (``>= 1``).
        num_threads: loader threads (``>= 1``; fewer when the epoch has fewer batches).
        transform: applied to each sample's input (see :func:`_apply_transform`), or ``None``.
        return_mask: batches are ``(batch, valid)`` with the plan's padding mask.
        device: a CUDA device to copy batches to on a side stream, or ``None``.
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    name: str = "train"
    seed: int = 0
    prefetch: int = 2
    num_threads: int = 1
    transform: Callable[[Any], Any] | None = None
    return_mask: bool = False
    device: torch.device | None = None


@dataclass
class LoadedBatch:
    """Batch ``k`` as a loader thread left it."""

    batch: Any
    event: Any  # torch.cuda.Event after a device copy on a side stream, else None

    def for_current_stream(self, device: torch.device | None) -> Any:
        """The batch, safe to use on the current CUDA stream of ``device`` (as is without a copy)."""
        if self.event is None:
            return self.batch
        current = torch.cuda.current_stream(device)
        current.wait_event(self.event)
        # The tensors were allocated on the side stream; tell the allocator they are used on the
        # compute stream so their memory is not reused before the step is done.
        _map_tensors(lambda t: t.record_stream(current), self.batch)
        return self.batch


@dataclass
class LoadFailure:
    """Loading batch ``k`` raised ``exc`` in the loader thread ``thread_name``."""

    exc: BaseException
    thread_name: str


def _apply_transform(transform: Callable[[Any], Any], sample: Any) -> Any:
    # Same convention as torchvision datasets' ``transform``: it sees the input, not the target.
    if isinstance(sample, tuple) and sample:
        if hasattr(sample, "_fields"):  # namedtuple: keep the type
            named: Any = sample  # a NamedTuple, which the tuple type does not spell
            return named._replace(**{named._fields[0]: transform(sample[0])})
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

    Args:
        spec: what to load and how.
        plan: this rank's indices for the epoch.
        epoch: the epoch (for per-sample seeds and thread names).
        tag: distinguishes this pipeline's thread names from other epochs' of the same loader.
    """

    def __init__(self, spec: LoadSpec, plan: ShardPlan, epoch: int, tag: str = "") -> None:
        self.spec = spec
        self.plan = plan
        self.epoch = epoch
        self.num_batches = plan.num_batches
        self.prefetch = spec.prefetch
        self.num_threads = max(1, min(spec.num_threads, self.num_batches))
        self.cond = threading.Condition()
        self.results: dict[int, LoadedBatch | LoadFailure] = {}
        self.next_consume = 0
        self.stopped = False
        self.threads = [
            threading.Thread(
                target=_worker_main,
                args=(self, t),
                name=f"lightning_mpi-prefetch-{spec.name}-e{epoch}{tag}-t{t}",
                # daemon: a thread stuck inside a user's __getitem__ must not keep the
                # interpreter alive at exit; close() still joins them in every normal path.
                daemon=True,
            )
            for t in range(self.num_threads)
        ]

    def start(self) -> None:
        for th in self.threads:
            th.start()

    def take(self, k: int) -> LoadedBatch | LoadFailure | None:
        """Wait for batch ``k`` (the next one: ``next_consume``), hand it over and let the threads
        load further. ``None`` when the pipeline was stopped from outside (teardown, a newer
        epoch) before the batch was in. Raises ``RuntimeError`` if the thread that owns batch
        ``k`` died without leaving a result."""
        with self.cond:
            while k not in self.results:
                if self.stopped:
                    return None
                producer = self.threads[k % self.num_threads]
                if not producer.is_alive() and k not in self.results:
                    raise RuntimeError(f"lightning_mpi: loader thread {producer.name} died without a result")
                self.cond.wait(timeout=1.0)
            item = self.results.pop(k)
            self.next_consume = k + 1
            self.cond.notify_all()
        return item

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
    device = pipe.spec.device
    stream = None
    if device is not None and device.type == "cuda":
        # One side stream per loader thread: copies overlap the compute stream and each other.
        stream = torch.cuda.Stream(device=device)
    for k in range(t, pipe.num_batches, pipe.num_threads):
        with pipe.cond:
            while not pipe.stopped and k >= pipe.next_consume + pipe.prefetch:
                pipe.cond.wait()
            if pipe.stopped:
                return
        try:
            item: LoadedBatch | LoadFailure | None = _load_batch(pipe, k, stream)
        except BaseException as exc:  # noqa: BLE001 - everything goes to the training loop
            item = LoadFailure(exc, threading.current_thread().name)
        if item is None:  # stopped mid-batch
            return
        with pipe.cond:
            if pipe.stopped:
                return
            pipe.results[k] = item
            pipe.cond.notify_all()
        if isinstance(item, LoadFailure):
            return  # the consumer stops the others when it reaches batch k


def _load_batch(pipe: Pipeline, k: int, stream: Any) -> LoadedBatch | None:
    spec = pipe.spec
    plan = pipe.plan
    sl = plan.batch_slice(k)
    samples = []
    for idx in plan.indices[sl]:
        if pipe.stopped:  # checked per sample so close() does not wait for a whole batch
            return None
        idx = int(idx)
        # Per-sample seed: the same augmentation for a sample in a given epoch whatever thread,
        # rank or world size loads it.
        with sample_seed(derive_seed(spec.seed, pipe.epoch, idx)):
            sample = spec.dataset[idx]
            if spec.transform is not None:
                sample = _apply_transform(spec.transform, sample)
        samples.append(sample)
    batch = spec.collate_fn(samples)
    if spec.return_mask:
        batch = (batch, torch.from_numpy(plan.valid[sl].copy()))
    event = None
    if stream is not None:
        device = spec.device
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # Pinned host memory makes the copy truly asynchronous; the caching host allocator
            # keeps the pinned block alive until the copy on this stream has completed.
            batch = _map_tensors(lambda t: t.pin_memory().to(device, non_blocking=True), batch)
            event = torch.cuda.Event()
            event.record(stream)
    return LoadedBatch(batch, event)
