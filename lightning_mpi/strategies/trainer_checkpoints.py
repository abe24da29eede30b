"""The Trainer's checkpoints with the rule's state, through heals, sharded optimizers and replacements.

:class:`TrainerCheckpoints` is what the Trainer strategy's ``save_checkpoint``,
``load_optimizer_state_dict`` and ``load_checkpoint`` call. The contract:

- save, on every rank: the bound rule's state (center, clocks, ...; sharded rule state is gathered
  here) goes into Lightning's checkpoint dictionary under :data:`~.rule_runner.CHECKPOINT_KEY`; then
  rank 0 writes it with Lightning's own save, or, with a sharded optimizer (``mpi_zero``), the file
  is a directory that every rank writes its optimizer shard and 1/W of the weights into
  (:func:`~lightning_mpi.checkpoint.sharded.save_sharded`). Under ``heal`` a rank lost anywhere in it
  (rank 0 in its write included) makes the survivors heal and save again
  (:func:`.checkpoint_io.save_through_heals`); the barrier that ends it stays local while a
  replacement catches up.
- load: a replacement's ``fit`` reads the survivors' handover instead of a file
  (:meth:`~.replacement.RunReplacing.checkpoint`); every other rank reads the file with
  Lightning's own load. The rule's state is restored into the rule (now, or when it is bound).
- optimizer states: each optimizer takes its saved state through
  :class:`~.optimizer_sharding.OptimizerSharding` (a sharded optimizer takes a sharded save at any
  world size), then moves to this rank's device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from lightning_mpi.checkpoint.sharded import save_sharded
from lightning_mpi.comm.transport import Transport
from lightning_mpi.strategies import collectives
from lightning_mpi.strategies.checkpoint_io import save_through_heals
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.optimizer_sharding import OptimizerSharding
from lightning_mpi.strategies.replacement import RunReplacing
from lightning_mpi.strategies.rule_runner import CHECKPOINT_KEY, RuleRunner


class CheckpointHost(Protocol):
    """What the checkpoints use of the Trainer strategy (Lightning's own properties)."""

    @property
    def transport(self) -> Transport: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def lightning_module(self) -> Any: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def root_device(self) -> torch.device: ...


class TrainerCheckpoints:
    """The Trainer strategy's saves and loads (see the module docstring).

    Args:
        optimizers_to_device: Lightning's ``optimizers_to_device`` (of the package in use).
    """

    def __init__(
        self,
        host: CheckpointHost,
        runner: RuleRunner,
        optimizer_sharding: OptimizerSharding,
        healing: RunHealing,
        replacing: RunReplacing,
        optimizers_to_device: Callable[[list[Optimizer], torch.device], None],
    ) -> None:
        self._host = host
        self._runner = runner
        self._optimizer_sharding = optimizer_sharding
        self._healing = healing
        self._replacing = replacing
        self._optimizers_to_device = optimizers_to_device

    def save(self, checkpoint: dict[str, Any], filepath: Any, write: Callable[[], None]) -> None:
        """Save ``checkpoint`` with the rule's state in it; ``write()`` is Lightning's own save of
        ``checkpoint`` to ``filepath`` (rank 0 writes)."""
        host = self._host

        def save() -> None:
            entry = self._runner.checkpoint(host.world_size)  # the rule as bound now (a heal rebinds it)
            if entry is not None:
                checkpoint[CHECKPOINT_KEY] = entry
            if self._optimizer_sharding.active:  # every rank writes its optimizer shard; nothing is gathered
                # and 1/W of the weights, which the Allgather made equal on every rank (buffers: rank 0's)
                params = {f"state_dict/{name}" for name, _ in host.lightning_module.named_parameters()}
                save_sharded(filepath, checkpoint, host.transport, spread=params)
            else:
                write()

        save_through_heals(self._healing, save, self._save_barrier, filepath, lambda: host.is_global_zero)

    def _save_barrier(self) -> None:
        """The barrier that ends a save under ``heal`` (local while a replacement catches up)."""
        if not self._replacing.catching_up:
            collectives.barrier(self._host.transport)

    def load_optimizer_states(self, checkpoint: Any) -> None:
        """Each optimizer's saved state; a sharded optimizer takes a sharded save at any world size."""
        # as Lightning's own: the states there are, in order
        for optimizer, saved in zip(self._host.optimizers, checkpoint["optimizer_states"], strict=False):
            self._optimizer_sharding.load_into(optimizer, saved)
            self._optimizers_to_device([optimizer], self._host.root_device)

    def load(self, checkpoint_path: Any, read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint at ``checkpoint_path`` (``read()`` is Lightning's own load of it), or a
        replacement's handover; the rule's state restored from it."""
        handed = self._replacing.checkpoint(checkpoint_path)  # heal="replace": the survivors' state
        checkpoint = handed if handed is not None else read()
        self._runner.restore(checkpoint.get(CHECKPOINT_KEY), self._host.world_size)
        return checkpoint
