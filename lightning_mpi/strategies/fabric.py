"""The Fabric frontend: ``L.Fabric(strategy="mpi_asa16")`` calls the rule's hooks here.

:class:`FabricMPIStrategy` is mixed into the ``ParallelStrategy`` of each Fabric package
(``lightning_fabric``, ``lightning.fabric``) by :mod:`lightning_mpi.strategies.build`. A Fabric loop
is the user's own code, so the rule's lifecycle hangs on the calls that loop makes:

- ``fabric.launch()``: nothing to spawn (``mpiexec`` started the ranks); this rank's device is set
  up, and an exception that nobody catches aborts every rank (``sys.excepthook``).
- ``fabric.setup(model, optimizer)`` / ``fabric.setup_module(model)``: every rank checks it built
  the same model and takes rank 0's weights; the rule is bound to the trainable parameters and
  starts (``on_train_start``).
- ``fabric.backward(loss)``: the synchronous rules' gradient hooks start their exchanges during
  backward; inside ``fabric.no_backward_sync(model)`` they do not (gradient accumulation).
- ``optimizer.step()``: the rule finishes its exchange (``before_step``), the optimizer updates
  unless the exchange rejected the step (non-finite gradients) and no GradScaler handles it, then
  ``after_step``.
- ``fabric.all_reduce`` / ``all_gather`` / ``broadcast`` / ``barrier``: over MPI.
- ``fabric.save`` / ``fabric.load`` with a state dictionary: the rule's state (center, clocks,
  residuals, gossip weights) travels under the ``"lightning_mpi"`` key.
- :meth:`FabricMPIStrategy.finish_training`: a Fabric loop has no ``on_train_end``, so call
  ``fabric.strategy.finish_training()`` on every rank after the loop: every rank's module then
  holds the rule's consensus weights (the center for elastic and parameter-server rules, the
  weighted consensus for gossip), and the rule's threads and windows are released.

When a rank fails. An exception raised inside any of the strategy's calls above (a collective, a
step, a checkpoint) fails the run on every rank: it is posted to the other ranks, which raise
``RankFailedError`` from their next strategy call, and the run is abandoned (see
:mod:`.failures`). An exception in the user's own code between those calls is not seen by the
strategy: wrap the loop in ``with fabric.strategy.propagate_errors():`` to catch and retry on every
rank, or leave it uncaught and every rank is aborted.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Optional, TypeVar

from torch.nn import Module
from torch.optim import Optimizer

from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies.aids import ConvergenceAids
from lightning_mpi.strategies.core import CHECKPOINT_KEY, MPIStrategyCore
from lightning_mpi.strategies.failures import install_abort_hook
from lightning_mpi.strategies.flags import check_num_nodes, checked_parallel_devices  # issue 27: devices=/num_nodes= against MPI

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _fails_the_run(method: _Method) -> _Method:
    """An exception raised inside ``method`` fails the run on every rank (``propagate_errors``)."""

    @functools.wraps(method)
    def propagating(self: "FabricMPIStrategy", *args: Any, **kwargs: Any) -> Any:
        with self.propagate_errors():
            return method(self, *args, **kwargs)

    return propagating  # type: ignore[return-value]


class _NoBackwardSync:
    """Fabric's ``_BackwardSyncControl``: ``fabric.no_backward_sync(model)`` pauses the rule's
    gradient hooks, so accumulation steps exchange nothing (mixed into the package's base class)."""

    def __init__(self, strategy: "FabricMPIStrategy") -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._strategy.exchanges_paused() if enabled else nullcontext()


class FabricMPIStrategy(ConvergenceAids, MPIStrategyCore):
    """Data-parallel training over MPI with an exchange rule, for ``lightning.fabric.Fabric``.

    Args:
        rule: what to exchange and when; defaults to :class:`~lightning_mpi.rules.sync.SyncRule`
            (average gradients with one Allreduce every step).
        abort_on_exception: ``False`` (default): an exception inside a strategy call (or a
            ``propagate_errors()`` block) propagates on its rank and every other rank raises
            :class:`~lightning_mpi.RankFailedError` from its next strategy call; an exception that
            reaches the top of the program aborts every rank (``sys.excepthook``, installed by
            ``fabric.launch()`` at world size > 1, whatever this option). ``True``: the failing rank
            prints its traceback and calls ``MPI_Abort`` at once.
        collective_timeout: seconds any collective may wait for the other ranks before it raises
            ``CollectiveTimeout``; ``None`` waits forever.
        lr_scaling: ``"linear"`` or ``"sqrt"`` scaling of every learning rate by the world size,
            applied to the update only (see the Trainer strategies); ``None`` leaves them alone.
        warmup_steps: linear warm-up of that factor over this many ``optimizer.step()`` calls.
        accelerator, checkpoint_io, precision: as for any Fabric strategy; normally left to Fabric.

    Ranks come from ``MPI.COMM_WORLD`` (``mpiexec -n N python train.py``); rank ``r`` uses device
    ``local_rank % devices_on_this_host``. See the module docstring for the lifecycle, and call
    :meth:`finish_training` after the training loop.
    """

    _fabric_api: Any
    _backward_sync_class: type

    def __init__(
        self,
        rule: Optional[Rule] = None,
        abort_on_exception: bool = False,
        collective_timeout: Optional[float] = 1800.0,
        lr_scaling: Optional[Literal["linear", "sqrt"]] = None,
        warmup_steps: int = 0,
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision: Optional[Any] = None,
    ) -> None:
        placement = self._placement(rule, collective_timeout, lr_scaling, warmup_steps, checkpoint_io)
        # the package's ParallelStrategy
        super().__init__(accelerator=accelerator, precision=precision, **placement)  # type: ignore[call-arg]
        self._init_core(rule, placement["cluster_environment"].comm, collective_timeout)
        self._init_aids(lr_scaling, warmup_steps)
        self.abort_on_exception = abort_on_exception
        self._optimizers: list[Optimizer] = []
        self._steps_seen = 0
        self._backward_sync_control = self._backward_sync_class(self)
        self._set_world_ranks()

    # -- where this rank lives -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self.cluster_environment.num_nodes  # type: ignore[attr-defined]

    @property
    def _num_nodes(self) -> int:
        return self.num_nodes

    @_num_nodes.setter
    def _num_nodes(self, value: int) -> None:
        # Fabric assigns its num_nodes flag; MPI knows better, so the flag is ignored.
        check_num_nodes(value, self.cluster_environment)  # issue 27: refuse a num_nodes= that MPI contradicts

    def _set_world_ranks(self) -> None:
        self.parallel_devices = checked_parallel_devices(self.parallel_devices, self.accelerator, self.cluster_environment)  # issue 27: refuse a devices= that MPI contradicts; one device per local rank
        self._fabric_api.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up with this strategy (for the convergence aids' announcements)."""
        return self._optimizers

    def _configure_launcher(self) -> None:
        self._launcher = None  # mpiexec (or srun, or the lightning-mpi launcher) started the ranks

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self._set_world_ranks()
        if self.world_size > 1:
            install_abort_hook(self.global_rank, self.world_size)

    # -- the model -------------------------------------------------------------------------------
    def module_to_device(self, module: Module) -> None:
        module.to(self.root_device)

    @_fails_the_run
    def setup_module(self, module: Module) -> Module:
        """Same model everywhere, rank 0's weights, the rule bound and started."""
        self.prepare_module(module)
        bound = self.bind_rule(module)
        bound.on_train_start()
        self.connect_metrics(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        self._announce_convergence_aids()
        return optimizer

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None) -> Any:
        module = self.setup_module(module)
        optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        return module, optimizers, scheduler

    # -- a step ------------------------------------------------------------------------------------
    def _optimizer_step_count(self) -> int:
        return self._steps_seen

    @_fails_the_run
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The rule's exchange (``before_step``), the update, then ``after_step``.

        The convergence aids (``lr_scaling``) change the param groups for the update only.
        """
        self.check_peers()
        overrides = self._step_overrides(optimizer)
        bound = self._bound
        try:
            with overrides if overrides is not None else nullcontext():
                if bound is None:
                    return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
                # A GradScaler already skips steps with inf gradients and lowers its scale: it must see them.
                scaler_handles_inf = getattr(self.precision, "scaler", None) is not None  # type: ignore[attr-defined]
                if not bound.before_step(optimizer) and not scaler_handles_inf:
                    return None
                output = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
                bound.after_step(optimizer)
                return output
        finally:
            self._steps_seen += 1
            if overrides is not None:
                self._record_aid_stats(overrides)

    @_fails_the_run
    def finish_training(self) -> None:
        """End training on every rank: leave the rule's consensus weights in the module (the center,
        the average, the gossip consensus) and release its threads and windows.

        Call it once, on every rank, after the training loop and before evaluating or saving the
        final model (it may be collective). A later ``fabric.setup`` binds the rule afresh.
        Calling it again does nothing.
        """
        bound = self._bound
        if bound is None:
            return
        bound.on_train_end()
        self.close_rule()
        self._bound = None

    def teardown(self) -> None:
        self.close_rule()
        super().teardown()  # type: ignore[misc]

    @_fails_the_run
    def backward(self, tensor: Any, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]

    # -- collectives --------------------------------------------------------------------------------
    @_fails_the_run
    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self.reduce(tensor, group=group, reduce_op=reduce_op)

    @_fails_the_run
    def all_gather(self, tensor: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @_fails_the_run
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return super().broadcast(obj, src)

    @_fails_the_run
    def barrier(self, name: Optional[str] = None) -> None:
        super().barrier(name)

    # -- checkpoints ---------------------------------------------------------------------------------
    @_fails_the_run
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        """Rank 0 writes ``state`` plus the rule's state; every rank takes part (sharded rule
        state is gathered here)."""
        entry = self.rule_checkpoint()
        if entry is not None:
            state = {**state, CHECKPOINT_KEY: entry}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]

    @_fails_the_run
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Fabric's load, and the rule's state restored from the ``"lightning_mpi"`` entry.

        With ``state`` a dictionary (or ``None``) the rule's state comes back too; loading into a
        bare module or optimizer restores only that object. The file holds the rule's own objects,
        so it is read with ``weights_only=False`` unless you say otherwise.
        """
        remainder = super().load_checkpoint(  # type: ignore[misc]
            path, state=state, strict=strict, weights_only=False if weights_only is None else weights_only
        )
        self.restore_rule(remainder.pop(CHECKPOINT_KEY, None))
        return remainder

