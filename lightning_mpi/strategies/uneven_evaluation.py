"""The warning Lightning's ``ddp`` gives when ``trainer.validate``/``test`` cannot evaluate every
sample exactly once, for the loaders the MPI strategies shard themselves.

Lightning's data connector warns (``PossibleUserWarning``, rank zero only) whenever it puts a
``DistributedSampler`` with more than one replica under a loader during ``trainer.validate()`` or
``trainer.test()``: to give every rank the same number of batches the sampler repeats samples
(301 test samples on 2 ranks are evaluated as 302), so metrics are slightly off. The MPI Trainer
strategies shard loaders themselves (:mod:`.sharding`), which bypasses that warning; these
functions give it back, with the same condition and the same text, except for the remedy
(``Trainer(devices=1, num_nodes=1)`` does not change the number of MPI ranks: ``mpiexec -n 1``
does) and a last sentence that says how many samples it concerns.

A custom batch sampler, which Lightning's ``ddp`` cannot shard at all, is dealt out whole batches
at a time and its last ``len % world_size`` batches are dropped (see
:class:`~lightning_mpi.data.batch_sampler.ShardedBatchSampler`): :func:`warn_if_batches_dropped`
says so in the same situations.
"""

from __future__ import annotations

import importlib
from collections.abc import Sized
from typing import Any, cast

#: The Trainer functions during which Lightning warns (``TrainerFn.VALIDATING``/``TESTING`` values).
EVALUATING = ("validate", "test")

#: Lightning's remedy does not apply under MPI: the launcher, not ``devices=``, sets the rank count.
_ONE_RANK = "run on one rank (`mpiexec -n 1`, or plain `python`)"


def _function_name(trainer_fn: Any) -> str:
    return str(getattr(trainer_fn, "value", trainer_fn))


def repeated_samples_message(num_samples: int, total_size: int, num_replicas: int, trainer_fn: Any) -> str | None:
    """Lightning's ``ddp`` warning for a ``DistributedSampler`` over ``num_samples`` samples that
    hands out ``total_size`` in all to ``num_replicas`` ranks during ``trainer_fn``, or ``None``
    where Lightning says nothing (one replica, or not ``validate``/``test``)."""
    fn = _function_name(trainer_fn)
    if num_replicas <= 1 or fn not in EVALUATING:
        return None
    message = (
        f"Using `DistributedSampler` with the dataloaders. During `trainer.{fn}()`, it is"
        f" recommended to {_ONE_RANK} to ensure each sample/batch gets evaluated"
        " exactly once. Otherwise, multi-device settings use `DistributedSampler` that replicates"
        " some samples to make sure all devices have same batch size in case of uneven inputs."
    )
    if total_size > num_samples:
        repeated = total_size - num_samples
        message += (
            f" Here {num_samples} samples are padded to {total_size} for {num_replicas} ranks:"
            f" {repeated} of them {_is_are(repeated)} evaluated twice."
        )
    elif total_size < num_samples:
        dropped = num_samples - total_size
        message += f" Here {dropped} of {num_samples} samples {_is_are(dropped)} dropped (drop_last=True)."
    return message


def _is_are(count: int) -> str:
    return "is" if count == 1 else "are"


def dropped_batches_message(num_batches: int, num_replicas: int, trainer_fn: Any) -> str | None:
    """The same warning for a custom batch sampler of ``num_batches`` batches dealt to
    ``num_replicas`` ranks, or ``None`` when every batch is evaluated (or not ``validate``/``test``)."""
    fn = _function_name(trainer_fn)
    dropped = num_batches % num_replicas if num_replicas > 1 else 0
    if not dropped or fn not in EVALUATING:
        return None
    return (
        f"Sharding a custom batch sampler over {num_replicas} ranks. During `trainer.{fn}()`, it is"
        f" recommended to {_ONE_RANK} to ensure each sample/batch gets evaluated exactly once."
        f" Otherwise every rank gets whole batches, and the last {dropped} of the {num_batches} batches"
        f" {_is_are(dropped)} not evaluated."
    )


def _warn(message: str | None, fabric_package: str) -> None:
    if message is None:
        return
    rank_zero = importlib.import_module(f"{fabric_package}.utilities.rank_zero")
    category = importlib.import_module(f"{fabric_package}.utilities.warnings").PossibleUserWarning
    rank_zero.rank_zero_warn(message, category=category)


def warn_if_samples_repeat(sampler: Any, trainer_fn: Any, fabric_package: str) -> None:
    """Rank 0 warns as Lightning's ``ddp`` does when ``sampler`` (the ``DistributedSampler`` just put
    under an evaluation loader) repeats samples; ``fabric_package`` ("lightning_fabric" or
    "lightning.fabric") gives ``rank_zero_warn`` and ``PossibleUserWarning``."""
    from torch.utils.data import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        num_samples = len(cast(Sized, sampler.dataset))  # a DistributedSampler needs a sized dataset
        message = repeated_samples_message(num_samples, sampler.total_size, sampler.num_replicas, trainer_fn)
        _warn(message, fabric_package)


def warn_if_batches_dropped(batch_sampler: Any, num_replicas: int, trainer_fn: Any, fabric_package: str) -> None:
    """Rank 0 warns when sharding ``batch_sampler`` over ``num_replicas`` ranks leaves batches out
    of ``trainer.validate``/``test``."""
    _warn(dropped_batches_message(len(batch_sampler), num_replicas, trainer_fn), fabric_package)
