"""Lightning's collectives over the current run, for both strategies: through a heal, and local
while a replacement catches up.

Each call of :class:`RunCollectives` is one of :mod:`.collectives` (over MPI, on the current run's
transport) with two rules around it:

- in a rank spawned to replace a lost one, before its first training batch
  (:attr:`~.replacement.RunReplacing.catching_up`), it returns at once with this rank's own answer
  (a reduction or broadcast returns the value given, a gather a stack of one, a barrier nothing):
  the survivors are past these points;
- otherwise it is one :meth:`~.healing.RunHealing.operation`: under ``heal`` a rank lost during it
  makes the survivors heal and run it again over the healed run.

``group`` must be ``None`` (:func:`.collectives.check_group`): MPI ranks have no process groups.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_mpi.strategies import collectives
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.replacement import RunReplacing


class RunCollectives:
    """The strategy's collectives (module docstring) on ``failures``' current transport."""

    def __init__(self, failures: RunFailures, healing: RunHealing, replacing: RunReplacing) -> None:
        self._failures = failures
        self._healing = healing
        self._replacing = replacing

    def reduce(self, tensor: Any, group: Any | None, reduce_op: Any | None, name: str = "reduce") -> Any:
        """``tensor`` reduced over the ranks by ``reduce_op`` (``"mean"``, ``"sum"``, ...)."""
        collectives.check_group(group)
        if self._replacing.catching_up:  # a replacement's start-up: the survivors are past it
            return tensor
        return self._healing.operation(name, lambda: collectives.reduce(self._failures.transport, tensor, reduce_op))

    def all_gather(self, tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
        """Every rank's ``tensor``, stacked along a new first dimension."""
        collectives.check_group(group)
        if self._replacing.catching_up:
            return tensor.unsqueeze(0)
        return self._healing.operation(
            "all_gather", lambda: collectives.all_gather(self._failures.transport, tensor, sync_grads)
        )

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self._replacing.catching_up:
            return obj
        return self._healing.operation("broadcast", lambda: collectives.broadcast(self._failures.transport, obj, src))

    def allgather_object(self, obj: Any) -> list[Any]:
        """torchmetrics' sync (:func:`.collectives.connect_metrics`): every rank's ``obj``."""
        if self._replacing.catching_up:
            return [obj]
        return self._healing.operation("a metric's sync", lambda: self._failures.transport.allgather_object(obj))

    def barrier(self) -> None:
        """Every rank waits for the others here."""
        if self._replacing.catching_up:
            return
        self._healing.operation("barrier", lambda: collectives.barrier(self._failures.transport))
