"""``heal="replace"`` under Fabric: what rank 0 hands a rank spawned to replace a lost one, and where
that rank takes it.

A Fabric loop is the user's own code, so new ranks are let in where it calls
``fabric.strategy.let_in(state)`` at the top of each iteration, with the state dictionary it would
give ``fabric.save`` (the model, the optimizer, its counters). :class:`FabricHandover` is the
Fabric side of :class:`~..replacement.RunReplacing` (which spawns, polls and lets in):

- on a survivor, :meth:`FabricHandover.let_in` looks for a failure first (a heal happens there),
  then passes ``state`` to :meth:`~..replacement.RunReplacing.at_batch_start` and returns ``False``;
- on rank 0 at a let-in, :meth:`FabricHandover.snapshot` is the handover's checkpoint:
  ``{"state": state as fabric.save converts it, "module": the bound module's weights,
  "steps_seen": the optimizer steps seen}`` (``RunReplacing`` adds the rule's kept state under the
  strategy's checkpoint key);
- in a new rank, the strategy's ``__init__`` takes the handover at once
  (:meth:`FabricHandover.receive`, collective with the survivors), ``fabric.setup`` loads
  :meth:`FabricHandover.module_weights` (no collective), and the first ``let_in(state)`` fills
  ``state`` in place as ``fabric.load`` would and returns ``True``: the loop goes on from the
  counters in it;
- a heal under ``heal="replace"`` in a loop that never called ``let_in`` trains on at the smaller
  world size, and :meth:`FabricHandover.warn_if_never_let_in` says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.lightning_api import FabricAPI
from lightning_mpi.strategies.optimizer_sharding import OptimizerSharding
from lightning_mpi.strategies.replacement import RunReplacing


class FabricHost(Protocol):
    """What the handover uses of the Fabric strategy: its device and Fabric's own conversions."""

    @property
    def root_device(self) -> torch.device: ...

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None: ...

    def _convert_stateful_objects_in_state(self, state: dict[str, Any], filter: dict[str, Any]) -> dict[str, Any]: ...


class FabricHandover:
    """The Fabric side of ``heal="replace"`` for one strategy (see the module docstring); inert otherwise.

    Args:
        api: the Fabric package's names (``unwrap_objects``, ``optimizers_to_device``, warnings).
        host: the strategy (:class:`FabricHost`).
        replacing: the strategy's :class:`~..replacement.RunReplacing`.
        healing: the strategy's :class:`~..healing.RunHealing` (a failure seen at a let-in heals there).
        failures: the strategy's :class:`~..failures.RunFailures` (the error channel).
        optimizer_sharding: the strategy's :class:`~..optimizer_sharding.OptimizerSharding` (a new
            rank's optimizer is loaded through it).
        checkpoint_key: where the rule's state is in the handover.
        module: the module the rule is bound to (``None`` before ``fabric.setup``).
        steps_seen: the optimizer steps this rank has seen.
    """

    def __init__(
        self,
        api: FabricAPI,
        host: FabricHost,
        replacing: RunReplacing,
        healing: RunHealing,
        failures: RunFailures,
        optimizer_sharding: OptimizerSharding,
        checkpoint_key: str,
        module: Callable[[], Module | None],
        steps_seen: Callable[[], int],
    ) -> None:
        self._api = api
        self._host = host
        self._replacing = replacing
        self._healing = healing
        self._failures = failures
        self._optimizer_sharding = optimizer_sharding
        self._key = checkpoint_key
        self._module = module
        self._steps_seen = steps_seen
        self._let_in_called = False

    def let_in(self, state: dict[str, Any]) -> bool:
        """``fabric.strategy.let_in(state)``: ``True`` in a new rank at its first call (``state`` filled
        from rank 0's), else ``False`` (the survivors let new ranks in here when they are ready)."""
        if self._replacing.catching_up:
            self._take(state)
            self._replacing.at_batch_start(state)  # ends the catch-up; counts this batch as the survivors do
            return True
        self._let_in_called = True
        if self._replacing.active:
            self._healing.between("the error channel", self._failures.check_peers, None)
            self._replacing.at_batch_start(state)
        return False

    def snapshot(self, state: dict[str, Any]) -> dict[str, Any]:
        """On rank 0 at a let-in: what a new rank takes: the loop's ``state`` as ``fabric.save``
        converts it, the bound module's weights, the optimizer steps seen."""
        module = self._module()
        return {
            "state": self._host._convert_stateful_objects_in_state(self._api.unwrap_objects(state), filter={}),
            "module": module.state_dict() if module is not None else None,
            "steps_seen": self._steps_seen(),
        }

    def receive(self) -> tuple[int, Any]:
        """In a new rank, right after it was let in: the survivors' handover (collective with them).
        Returns the optimizer steps rank 0 has seen and the rule's state (``None``: none kept)."""
        self._replacing.receive()
        handed = self._handed()
        return int(handed["steps_seen"]), handed.get(self._key)

    def module_weights(self) -> dict[str, Any]:
        """In a new rank: rank 0's weights of the bound module, for ``fabric.setup``."""
        weights: dict[str, Any] = self._handed()["module"]
        return weights

    def warn_if_never_let_in(self, world_size: int) -> None:
        """After a heal: under ``heal="replace"``, say once that a loop that does not call ``let_in``
        lets no new rank in."""
        if self._replacing.active and not self._let_in_called and not self._replacing.catching_up:
            self._let_in_called = True  # said once
            self._api.rank_zero_warn(
                "lightning_mpi: heal='replace' lets new ranks in where the training loop calls "
                "fabric.strategy.let_in(state) (at the top of each iteration); this loop has not called it, so "
                f"training goes on at world size {world_size}"
            )

    def _handed(self) -> dict[str, Any]:
        handover = self._replacing.handover
        assert handover is not None, "a new rank receives the handover when it joins"
        return handover.checkpoint

    def _take(self, state: dict[str, Any]) -> None:
        """In a new rank: ``state`` filled in place from rank 0's, as ``fabric.load`` fills it (a
        sharded optimizer keeps the shard rebuilt when it was set up)."""
        handed = self._handed()["state"]
        for name, obj in list(state.items()):
            if name not in handed:
                continue
            inner = self._api.unwrap_objects(obj)
            if isinstance(inner, Module):
                self._host.load_module_state_dict(inner, handed[name])
            elif isinstance(inner, Optimizer):
                self._optimizer_sharding.load_into(inner, handed[name])
                self._api.optimizers_to_device([inner], self._host.root_device)
            elif callable(getattr(inner, "load_state_dict", None)) and callable(getattr(inner, "state_dict", None)):
                inner.load_state_dict(handed[name])
            else:
                state[name] = handed[name]
