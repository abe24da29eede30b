"""``fabric.save`` / ``fabric.load`` with the rule's state, through heals and sharded optimizers.

:class:`FabricCheckpoints` is what the Fabric strategy's ``save_checkpoint`` and ``load_checkpoint``
call. The contract:

- save, on every rank: the bound rule's state (center, clocks, residuals, gossip weights; sharded
  rule state is gathered here) is added to the user's ``state`` under
  :data:`~..rule_runner.CHECKPOINT_KEY` (``state`` itself is not changed); then rank 0 writes the
  file with Fabric's own save, or, with a sharded optimizer (``mpi_zero``), every rank writes its
  shard into a sharded checkpoint (:func:`~lightning_mpi.checkpoint.sharded.save_sharded`) and
  nothing is gathered. Under ``heal`` a rank lost anywhere in it makes the survivors heal and save
  again (:meth:`..core.StrategyCore.save_through_heals`; the barrier that ends it stays local while a
  replacement catches up). With no rule bound (after
  ``finish_training``) the file holds no rule state.
- load: Fabric's own load, except that in a sharded checkpoint each optimizer of ``state`` is
  loaded from every rank's shard through :class:`~..optimizer_sharding.OptimizerSharding` (at any
  world size); the rule's state is taken out of what is returned and restored into the rule (now,
  or when it is bound).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch.optim import Optimizer

from lightning_mpi.checkpoint.sharded import is_sharded_checkpoint, save_sharded
from lightning_mpi.strategies.core import StrategyCore
from lightning_mpi.strategies.rule_runner import CHECKPOINT_KEY


class CheckpointHost(Protocol):
    """What the checkpoints use of the Fabric strategy: Fabric's conversion of stateful objects
    (modules, optimizers) to their state dictionaries."""

    def _convert_stateful_objects_in_state(self, state: dict[str, Any], filter: dict[str, Any]) -> dict[str, Any]: ...


class FabricCheckpoints:
    """The Fabric strategy's saves and loads (see the module docstring).

    Args:
        host: the strategy (:class:`CheckpointHost`).
        core: the strategy's :class:`~..core.StrategyCore` (the rule, the run, heals, ZeRO).
    """

    def __init__(self, host: CheckpointHost, core: StrategyCore) -> None:
        self._host = host
        self._core = core

    def save(
        self,
        path: Any,
        state: dict[str, Any],
        filter: dict[str, Any] | None,
        write: Callable[[dict[str, Any]], None],
    ) -> None:
        """Save ``state`` and the rule's state to ``path``; ``write(full)`` is Fabric's own save of
        ``full`` (rank 0 writes)."""

        def save(entry: dict[str, Any] | None) -> None:
            full = state if entry is None else {**state, CHECKPOINT_KEY: entry}
            if self._core.optimizer_sharding.active:  # every rank writes its optimizer shard; nothing is gathered
                converted = self._host._convert_stateful_objects_in_state(full, filter=filter or {})
                save_sharded(path, converted, self._core.transport)
            else:
                write(full)

        self._core.save_through_heals(path, save)

    def load(self, path: Any, state: Any | None, read: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """Load ``path`` into ``state``; ``read(state)`` is Fabric's own load into ``state``. Returns
        what Fabric's load returns, less the rule's state (restored into the rule)."""
        # A sharded checkpoint's optimizer entries hold every rank's shard: each optimizer is
        # loaded here (through the rule when it is sharded), the rest as Fabric loads it.
        optimizers = {}
        if isinstance(state, dict) and is_sharded_checkpoint(path):
            optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
            state = {name: obj for name, obj in state.items() if name not in optimizers}
        remainder = read(state)
        for name, optimizer in optimizers.items():
            self._core.optimizer_sharding.load_into(optimizer, remainder.pop(name))
        self._core.runner.restore(remainder.pop(CHECKPOINT_KEY, None), self._core.world_size)
        return remainder
