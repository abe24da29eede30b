"""Lightning's collectives over the current run, for both strategies: through a heal, and local
while a replacement catches up.

Each call of :class:`RunCollectives` is one of :mod:`.collectives` (over MPI, on the current run's
transport) with three rules around it:

- in a rank spawned to replace a lost one, before its first training batch
  (:attr:`~.replacement.RunReplacing.catching_up`), it returns at once with this rank's own answer
  (a reduction or broadcast returns the value given, a gather a stack of one, a barrier nothing):
  the survivors are past these points;
- otherwise it is one :meth:`~.healing.RunHealing.operation`: under ``heal`` a rank lost during it
  makes the survivors heal and run it again over the healed run;
- before its data moves, every rank checks that the others are at the same collective, with data
  of the same shape (one small ``Allreduce``): two ranks that called different collectives (a
  branch on the rank, a rank that stopped training before another) raise
  :class:`~lightning_mpi.comm.transport.CollectiveMismatch` naming each rank's call, instead of
  exchanging each other's bytes.

``group`` must be ``None`` (:func:`.collectives.check_group`): MPI ranks have no process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import Tensor

from lightning_mpi.comm.transport import Transport
from lightning_mpi.strategies import collectives
from lightning_mpi.strategies.failures import RunFailures
from lightning_mpi.strategies.healing import RunHealing
from lightning_mpi.strategies.replacement import RunReplacing

_T = TypeVar("_T")


def _shape(value: Any) -> str:
    """What the check of :meth:`RunCollectives._run` compares of a collective's data."""
    return f"{value.dtype}{list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


class RunCollectives:
    """The strategy's collectives (module docstring) on ``failures``' current transport."""

    def __init__(self, failures: RunFailures, healing: RunHealing, replacing: RunReplacing) -> None:
        self._failures = failures
        self._healing = healing
        self._replacing = replacing
        #: the collectives this rank has run (started) through this object: the same count at the
        #: same point of every rank's loop (the Trainer's stop decisions compare them)
        self.count = 0

    def _run(self, where: str, call: str, run: Callable[[Transport], _T]) -> _T:
        """``run(transport)`` as one operation (module docstring), after every rank agreed that it is
        at the same collective (``call``: what it is and the shape of its data;
        :meth:`~lightning_mpi.comm.transport.Transport.same_collective`)."""

        def checked() -> _T:
            transport = self._failures.transport
            if transport.size > 1:
                transport.same_collective(call)
            return run(transport)

        self.count += 1
        return self._healing.operation(where, checked)

    def reduce(self, tensor: Any, group: Any | None, reduce_op: Any | None, name: str = "reduce") -> Any:
        """``tensor`` reduced over the ranks by ``reduce_op`` (``"mean"``, ``"sum"``, ...)."""
        collectives.check_group(group)
        if self._replacing.catching_up or not isinstance(tensor, Tensor):  # a replacement's start-up: the
            return tensor  # survivors are past it; a value that is no tensor is not reduced
        call = f"reduce ({collectives.reduce_op_name(reduce_op)}) of {_shape(tensor)}"
        return self._run(name, call, lambda transport: collectives.reduce(transport, tensor, reduce_op))

    def all_gather(self, tensor: Tensor, group: Any | None, sync_grads: bool) -> Tensor:
        """Every rank's ``tensor``, stacked along a new first dimension."""
        collectives.check_group(group)
        if self._replacing.catching_up:
            return tensor.unsqueeze(0)
        call = f"all_gather of {_shape(tensor)}"
        return self._run("all_gather", call, lambda transport: collectives.all_gather(transport, tensor, sync_grads))

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self._replacing.catching_up:
            return obj
        return self._run(
            "broadcast", f"broadcast from rank {src}", lambda transport: collectives.broadcast(transport, obj, src)
        )

    def allgather_object(self, obj: Any) -> list[Any]:
        """torchmetrics' sync (:func:`.collectives.connect_metrics`): every rank's ``obj``."""
        if self._replacing.catching_up:
            return [obj]
        return self._run("a metric's sync", "a metric's sync", lambda transport: transport.allgather_object(obj))

    def barrier(self) -> None:
        """Every rank waits for the others here."""
        if self._replacing.catching_up:
            return
        self._run("barrier", "barrier", collectives.barrier)
