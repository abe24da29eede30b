"""The Trainer's checkpoints with the rule's state, through heals, sharded optimizers and replacements.

:class:`TrainerCheckpoints` is what the Trainer strategy's ``save_checkpoint``,
``load_optimizer_state_dict`` and ``load_checkpoint`` call. The contract:

- save, on every rank: the bound rule's state (center, clocks, ...; sharded rule state is gathered
  here) goes into Lightning's checkpoint dictionary under :data:`~..rule_runner.CHECKPOINT_KEY`; then
  rank 0 writes it with Lightning's own save, or, with a sharded optimizer (``mpi_zero``), the file
  is a directory that every rank writes its optimizer shard and 1/W of the weights into
  (:func:`~lightning_mpi.checkpoint.sharded.save_sharded`). Under ``heal`` a rank lost anywhere in it
  (rank 0 in its write included) makes the survivors heal and save again
  (:meth:`..core.StrategyCore.save_through_heals`); the barrier that ends it stays local while a
  replacement catches up.
- load: a replacement's ``fit`` reads the survivors' handover instead of a file
  (:meth:`~..replacement.RunReplacing.checkpoint`); every other rank reads the file with
  Lightning's own load. The rule's state is restored into the rule (now, or when it is bound).
- optimizer states: each optimizer takes its saved state through
  :class:`~..optimizer_sharding.OptimizerSharding` (a sharded optimizer takes a sharded save at any
  world size), then moves to this rank's device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from lightning_mpi.checkpoint.sharded import save_sharded
from lightning_mpi.strategies.core import StrategyCore
from lightning_mpi.strategies.rule_runner import CHECKPOINT_KEY

#: Where a handover (``heal="replace"``) carries what each ``ModelCheckpoint`` saved last
HANDED_SAVES_KEY = "lightning_mpi_checkpoint_saves"


def handover_checkpoint(trainer: Any) -> dict[str, Any]:
    """What the survivors hand a new rank (``heal="replace"``): Lightning's checkpoint dictionary of
    this moment, and what each ``ModelCheckpoint`` saved last (its step and path). Those two are no
    part of a callback's state in a checkpoint, yet they decide whether it saves at the end of
    training (``save_last=True`` saves there when this process saved nothing yet), and that save
    is collective (``file_exists`` reduces a decision over the ranks): a new rank that had not
    saved went into that reduction alone, the survivors into their end of training, and the job
    did not end (measured: ``benchmarks/goodput.py``, a replacement let in after the last periodic
    save)."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint()
    checkpoint[HANDED_SAVES_KEY] = {
        callback.state_key: (callback._last_global_step_saved, callback._last_checkpoint_saved)
        for callback in trainer.checkpoint_callbacks
        if hasattr(callback, "_last_checkpoint_saved")  # a ModelCheckpoint (of either Lightning package)
    }
    return checkpoint


def adopt_saves(trainer: Any, handed: dict[str, Any]) -> None:
    """In a new rank: what the survivors' ``ModelCheckpoint``\\ s saved last (:func:`handover_checkpoint`)."""
    saves = handed.get(HANDED_SAVES_KEY, {})
    for callback in trainer.checkpoint_callbacks:
        if callback.state_key in saves:
            callback._last_global_step_saved, callback._last_checkpoint_saved = saves[callback.state_key]


class CheckpointHost(Protocol):
    """What the checkpoints use of the Trainer strategy (Lightning's own properties)."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def root_device(self) -> torch.device: ...


class TrainerCheckpoints:
    """The Trainer strategy's saves and loads (see the module docstring).

    Args:
        host: the strategy (:class:`CheckpointHost`).
        core: the strategy's :class:`~..core.StrategyCore` (the rule, the run, heals, replacements).
        optimizers_to_device: Lightning's ``optimizers_to_device`` (of the package in use).
    """

    def __init__(
        self,
        host: CheckpointHost,
        core: StrategyCore,
        optimizers_to_device: Callable[[list[Optimizer], torch.device], None],
    ) -> None:
        self._host = host
        self._core = core
        self._optimizers_to_device = optimizers_to_device

    def save(self, checkpoint: dict[str, Any], filepath: Any, write: Callable[[], None]) -> None:
        """Save ``checkpoint`` with the rule's state in it; ``write()`` is Lightning's own save of
        ``checkpoint`` to ``filepath`` (rank 0 writes)."""

        def save(entry: dict[str, Any] | None) -> None:
            if entry is not None:
                checkpoint[CHECKPOINT_KEY] = entry
            sharding = self._core.optimizer_sharding
            if sharding.active:  # every rank writes its optimizer shard; nothing is gathered
                # and 1/W of the weights where the rule keeps them equal on every rank (ZeRO's Allgather;
                # buffers: rank 0's), else rank 0 writes its own (mpi_hybrid's replicas step apart)
                names = self._host.lightning_module.named_parameters() if sharding.spreads_weights else ()
                params = {f"state_dict/{name}" for name, _ in names}
                save_sharded(filepath, checkpoint, self._core.transport, spread=params)
            else:
                write()

        self._core.save_through_heals(filepath, save)

    def load_optimizer_states(self, checkpoint: Any) -> None:
        """Each optimizer's saved state; a sharded optimizer takes a sharded save at any world size."""
        # as Lightning's own: the states there are, in order
        for optimizer, saved in zip(self._host.optimizers, checkpoint["optimizer_states"], strict=False):
            self._core.optimizer_sharding.load_into(optimizer, saved)
            self._optimizers_to_device([optimizer], self._host.root_device)

    def load(self, checkpoint_path: Any, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint at ``checkpoint_path`` (``read()`` is Lightning's own load of it), or a
        replacement's handover; the rule's state restored from it."""
        handed = self._core.replacing.checkpoint(checkpoint_path)  # heal="replace": the survivors' state
        if handed is not None:
            adopt_saves(self._host.lightning_module.trainer, handed)
        checkpoint = handed if handed is not None else read()
        self._core.runner.restore(checkpoint.get(CHECKPOINT_KEY), self._core.world_size)
        return checkpoint
