"""``PrefetchDataHooks``: the logic of ``PrefetchDataModule``, free of any Lightning import.

Rank and world size come from MPI; one :class:`~lightning_mpi.data.loader.PrefetchLoader` is
built per stage; the epoch is ``trainer.current_epoch``; wait times are logged; every loader
thread stops on teardown or on an exception. Keeping Lightning out of this class lets one
implementation serve every Lightning frontend (``pytorch_lightning``, ``lightning.pytorch``):
each frontend's DataModule is this mixin plus that frontend's ``LightningDataModule``
(:mod:`lightning_mpi.data.module`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_mpi.data.checks import check_bool, check_dataset, check_int
from lightning_mpi.data.loader import PrefetchLoader
from lightning_mpi.data.pipeline import LoaderStats

__all__ = ["PrefetchDataHooks"]


def _mpi_rank_size(comm: Any) -> tuple[int, int]:
    if comm is None:
        from mpi4py import MPI  # imported here: importing initialises MPI

        comm = MPI.COMM_WORLD
    if not (hasattr(comm, "Get_rank") and hasattr(comm, "Get_size")):
        raise ValueError(
            "PrefetchDataModule: comm must be an MPI communicator (Get_rank/Get_size) or None, "
            f"got {type(comm).__name__}"
        )
    return int(comm.Get_rank()), int(comm.Get_size())


class PrefetchDataHooks:
    """Shard map-style datasets over MPI ranks and load them in background threads.

    ``PrefetchDataHooks`` is the whole DataModule without Lightning: mixed in before a
    frontend's ``LightningDataModule`` (``class PrefetchDataModule(PrefetchDataHooks,
    pl.LightningDataModule)``), it supplies the dataloader, ``setup``, ``teardown`` and
    ``on_exception`` hooks and reads ``self.trainer``, which the LightningDataModule holds.

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
    processes: no ``fork`` of an MPI process and no copy of the dataset; see
    :mod:`lightning_mpi.data.pipeline`).
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

    #: the Trainer, or ``None`` before it attached the DataModule (``LightningDataModule`` sets it)
    trainer: Any

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
        super().__init__()  # the frontend's LightningDataModule, next in the MRO
        where = "PrefetchDataModule"
        self.batch_size = check_int("batch_size", batch_size, 1, where)
        self.shuffle = check_bool("shuffle", shuffle, where)
        self.seed = check_int("seed", seed, 0, where)
        self.drop_last = check_bool("drop_last", drop_last, where)
        self.prefetch = check_int("prefetch", prefetch, 1, where)
        self.num_threads = check_int("num_threads", num_threads, 1, where)
        self.return_mask = check_bool("return_mask", return_mask, where)
        self.pin_memory = check_bool("pin_memory", pin_memory, where)
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
        n_train = check_dataset("train_dataset", train_dataset, where)
        if val_dataset is not None:
            check_dataset("val_dataset", val_dataset, where)
        if test_dataset is not None:
            check_dataset("test_dataset", test_dataset, where)
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
