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
  replacement catches up). After ``finish_training`` the file holds the state the rule ended with
  (:meth:`~..rule_runner.RuleRunner.end`), and a sharded optimizer's shards; before the rule was
  ever bound (before ``fabric.setup``), no rule state.
- load: Fabric's own load, except that in a sharded checkpoint each optimizer of ``state`` is
  loaded from every rank's shard through :class:`~..optimizer_sharding.OptimizerSharding` (at any
  world size), the other entries as Fabric loads them (plain values into ``state``, what ``state``
  does not name returned); the rule's state is taken out of what is returned and restored into the
  rule (now, or when it is bound). A file without the rule's state that replaces the weights of the
  module the rule runs on (saved before ``fabric.setup``, or by another strategy) binds the rule
  afresh on them, as ``fabric.setup`` does: its copies of the weights (a center, DiLoCo's
  θ_global) would otherwise pull the model back to the weights it had before the load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.nn import Module
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
        module: the module the rule is bound to (``None`` before ``fabric.setup``).
    """

    def __init__(self, host: CheckpointHost, core: StrategyCore, module: Callable[[], Module | None]) -> None:
        self._host = host
        self._core = core
        self._module = module

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
        # loaded here (through the rule when it is sharded), the rest as Fabric loads it, into a
        # copy of ``state`` without them, whose restored plain values (counters) go back to ``state``.
        optimizers = {}
        rest = state
        if isinstance(state, dict) and is_sharded_checkpoint(path):
            optimizers = {name: obj for name, obj in state.items() if isinstance(obj, Optimizer)}
            rest = {name: obj for name, obj in state.items() if name not in optimizers}
        remainder = read(rest)
        if isinstance(state, dict) and isinstance(rest, dict) and rest is not state:
            state.update(rest)
        for name, optimizer in optimizers.items():
            self._core.optimizer_sharding.load_into(optimizer, remainder.pop(name))
        saved = remainder.pop(CHECKPOINT_KEY, None)
        self._core.runner.restore(saved, self._core.world_size)
        if saved is None and self._replaces_bound_weights(state):
            self._bind_afresh()
        return remainder

    def _replaces_bound_weights(self, state: Any) -> bool:
        """Whether loading ``state`` loaded the weights of the module the rule runs on."""
        module = self._module()
        if module is None or not self._core.runner.live:
            return False
        loaded = state.values() if isinstance(state, dict) else [state]
        return any(obj is module for obj in loaded)

    def _bind_afresh(self) -> None:
        """The rule bound anew to the module's loaded weights and started, as ``fabric.setup`` binds
        it (collective: every rank loads). The running binding is ended first, so that closing it
        releases its windows on every rank; the weights its end leaves are replaced by the loaded
        ones. A rule that shards the optimizer keeps its binding: it holds no copy of the weights
        beside the optimizer state, which is loaded with them."""
        module = self._module()
        if module is None or self._core.optimizer_sharding.active:
            return
        loaded = [p.detach().clone() for p in module.parameters()]
        self._core.end_training()
        with torch.no_grad():
            for param, value in zip(module.parameters(), loaded, strict=True):
                param.copy_(value)
        self._core.bind(module).on_train_start()
