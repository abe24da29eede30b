"""The Fabric strategy: ``L.Fabric(strategy="mpi_asa16")`` calls the rule's hooks here.

:func:`fabric_strategy` defines ``MPIStrategy`` on the ``ParallelStrategy`` of one Fabric package
(``lightning_fabric`` or ``lightning.fabric``; :mod:`..build` calls it once per package), holding a
:class:`~..core.StrategyCore` as the Trainer strategy does (:mod:`..trainer.strategy`). A Fabric loop is the
user's own code, so the rule's lifecycle hangs on the calls that loop makes:

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
- ``fabric.strategy.let_in(state)`` (``heal="replace"``), at the top of each iteration with the
  state dictionary you would save: where ranks spawned to replace lost ones join; a spawned rank's
  first call fills ``state`` with rank 0's (see :mod:`.handover`).
- ``fabric.strategy.finish_training()``: a Fabric loop has no ``on_train_end``, so call it on every
  rank after the loop: every rank's module then holds the rule's consensus weights (the center
  for elastic and parameter-server rules, the weighted consensus for gossip, DiLoCo's mean of the
  replicas), and the rule's threads and windows are released. A ``fabric.save`` after it holds those
  weights and the state the rule ended with (and a sharded optimizer's shards), so a run can go on
  from it. Under ``heal`` a rank lost inside it heals there and the final exchange is redone over
  the survivors (:meth:`..core.StrategyCore.end_training`).

When a rank fails. An exception raised inside any of the strategy's calls above (a collective, a
step, a checkpoint) fails the run on every rank: it is posted to the other ranks, which raise
``RankFailedError`` from their next strategy call, and the run is abandoned (see
:mod:`..failures`). An exception in the user's own code between those calls is not seen by the
strategy: wrap the loop in ``with fabric.strategy.propagate_errors():`` to catch and retry on every
rank, or leave it uncaught and every rank is aborted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies import collectives, replicas
from lightning_mpi.strategies.core import CoreAttribute, StrategyCore
from lightning_mpi.strategies.fabric.checkpoints import FabricCheckpoints
from lightning_mpi.strategies.fabric.handover import FabricHandover
from lightning_mpi.strategies.fabric.step import FabricStep
from lightning_mpi.strategies.lightning_api import FabricAPI
from lightning_mpi.strategies.replacement import LoopAccess
from lightning_mpi.strategies.rule_runner import CHECKPOINT_KEY, RuleRunner
from lightning_mpi.strategies.signatures import document_frontend

_Arguments = ParamSpec("_Arguments")
_Result = TypeVar("_Result")

#: The Fabric strategy's own arguments (beside the common options), documented once.
FABRIC_ARGUMENTS = {
    "rule": "what to exchange and when (a lightning_mpi `Rule`); None is `SyncRule()`: average gradients with one "
    "Allreduce every step. The named strategies build it from their arguments.",
    "accelerator": "as for any Fabric strategy; normally left to Fabric.",
    "checkpoint_io": "as for any Fabric strategy; by default checkpoint files are written atomically.",
    "precision": "as for any Fabric strategy; normally left to Fabric.",
}


def _fails_the_run(
    method: Callable[Concatenate[Any, _Arguments], _Result],
) -> Callable[Concatenate[Any, _Arguments], _Result]:
    """An exception raised inside ``method`` fails the run on every rank (``propagate_errors``)."""

    @functools.wraps(method)
    def propagating(self: Any, *args: _Arguments.args, **kwargs: _Arguments.kwargs) -> _Result:
        with self.propagate_errors():
            return method(self, *args, **kwargs)

    return propagating


def fabric_strategy(api: FabricAPI, environment_class: type, checkpoint_io_class: type) -> type:
    """``MPIStrategy`` on Fabric package ``api``'s ``ParallelStrategy`` (see the module docstring)."""
    base: Any = api.ParallelStrategy  # a class of the package the user imported: known at run time only
    backward_sync_base: Any = api.BackwardSyncControl

    class NoBackwardSync(backward_sync_base):
        """``fabric.no_backward_sync(model)`` pauses the rule's gradient hooks, so accumulation steps
        exchange nothing."""

        def __init__(self, runner: RuleRunner) -> None:
            self._runner = runner

        @override
        def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager[Any]:
            return self._runner.paused() if enabled else nullcontext()

    class MPIStrategy(base):
        """Data-parallel training over MPI with an exchange rule, for ``lightning.fabric.Fabric``.

        Ranks come from ``MPI.COMM_WORLD`` (``mpiexec -n N python train.py``); rank ``r`` uses device
        ``local_rank % devices_on_this_host``. Call ``fabric.strategy.finish_training()`` after the
        training loop (see the module docstring of ``lightning_mpi.strategies.fabric``).
        """

        parallel_devices: list[torch.device] | None  # Lightning's property, declared for the type checker

        def __init__(
            self,
            rule: Rule | None = None,
            accelerator: Any | None = None,
            checkpoint_io: Any | None = None,
            precision: Any | None = None,
            **options: Any,
        ) -> None:
            loop = LoopAccess(
                snapshot=lambda state: self._handover.snapshot(state),
                step=lambda _: self._step.steps_seen,
                batches_done=lambda _: 0,
            )
            self._core = StrategyCore(rule, options, api, environment_class, self._adopt_healed_run, loop)
            super().__init__(
                accelerator=accelerator,
                parallel_devices=None,
                cluster_environment=self._core.environment,
                checkpoint_io=checkpoint_io if checkpoint_io is not None else checkpoint_io_class(),
                precision=precision,
            )
            core = self._core
            self._module: Module | None = None  # the module the rule is bound to
            self._backward_sync_control = NoBackwardSync(core.runner)
            self._optimizers: list[Optimizer] = []
            self._step = FabricStep(core.runner, core.healing, core.failures, core.aids)
            self._handover = FabricHandover(
                api,
                self,
                core.replacing,
                core.healing,
                core.failures,
                core.optimizer_sharding,
                CHECKPOINT_KEY,
                module=lambda: self._module,
                steps_seen=lambda: self._step.steps_seen,
            )
            self._checkpoints = FabricCheckpoints(self, core, module=lambda: self._module)
            core.replacing.join()  # a process spawned to replace a lost rank joins the run here
            self._set_world_ranks()
            if core.replacing.catching_up:  # ... and takes the survivors' state at once (collective)
                self._step.steps_seen, rule_state = self._handover.receive()
                core.runner.restore(rule_state, self.world_size)

        # -- what the user reads and sets (the core's: see :class:`..core.StrategyCore`) ----------------------
        options = CoreAttribute()
        rule = CoreAttribute()
        bound_rule = CoreAttribute()
        transport = CoreAttribute()
        collective_timeout = CoreAttribute()
        abort_on_exception = CoreAttribute()
        lr_scaling = CoreAttribute()
        warmup_steps = CoreAttribute()
        implicit_momentum_correction = CoreAttribute()

        @property
        def optimizers(self) -> list[Optimizer]:
            """The optimizers set up with this strategy (for the convergence aids' announcements)."""
            return self._optimizers

        def stats(self) -> dict[str, float]:
            """The rule's numbers for the last step (``mpi/<rule>/...``, world size > 1) and the
            convergence aids' values: log them with ``fabric.log_dict(fabric.strategy.stats())``."""
            return self._core.stats()

        @_fails_the_run
        def let_in(self, state: dict[str, Any]) -> bool:
            """Where ranks spawned to replace lost ones join (``heal="replace"``): call it on every
            rank at the top of each iteration of the training loop, with the state dictionary you
            would give ``fabric.save`` (the model, the optimizer, your counters).

            On the survivors it spawns the ranks lost in a heal, and once they are ready lets them
            in here (the same iteration on every survivor), handing them rank 0's ``state``, the
            rule's state and rank 0's weights; ``fabric.world_size`` and ``fabric.global_rank`` are
            then the grown run's. In a spawned rank (your script runs from the top; ``fabric.setup``
            gives it rank 0's weights, its collectives before this call return at once) the first
            call fills ``state`` in place as ``fabric.load`` would, and returns ``True``: go on from
            the counters it holds. Returns ``False`` otherwise. Without ``heal="replace"`` it only
            returns ``False``.
            """
            return self._handover.let_in(state)

        def propagate_errors(self) -> AbstractContextManager[None]:
            """Run a block whose exceptions fail the run on every rank (see :mod:`..failures`)."""
            return self._core.propagate_errors()

        # -- where this rank lives -----------------------------------------------------------------------
        @property
        @override
        def root_device(self) -> torch.device:
            """Rank ``r`` uses device ``local_rank % devices_on_this_host`` (the CPU without devices)."""
            return self._core.device(self.parallel_devices, self.local_rank)

        @property
        def num_nodes(self) -> int:
            return self._core.num_nodes

        @property
        def _num_nodes(self) -> int:
            return self.num_nodes

        @_num_nodes.setter
        def _num_nodes(self, value: int) -> None:
            # Fabric assigns its num_nodes flag; MPI decides, and a flag that contradicts it is refused.
            self._core.refuse_num_nodes(value)

        def _set_world_ranks(self) -> None:
            # Fabric has set parallel_devices from devices= by now: refuse one that MPI contradicts,
            # and keep one device per rank on this host.
            self.parallel_devices = self._core.devices(self.parallel_devices, self.accelerator)
            api.rank_zero_only.rank = self.global_rank

        @override
        def _configure_launcher(self) -> None:
            self._launcher = None  # mpiexec (or srun, or the lightning-mpi launcher) started the ranks

        @override
        def setup_environment(self) -> None:
            super().setup_environment()
            self._set_world_ranks()
            self._core.abort_when_uncaught()

        # -- the model -------------------------------------------------------------------------------------
        @override
        def module_to_device(self, module: Module) -> None:
            module.to(self.root_device)

        @override
        @_fails_the_run
        def setup_module(self, module: Module) -> Module:
            """Same model everywhere, rank 0's weights, the rule bound and started."""
            if self._core.replacing.catching_up:  # a new rank: rank 0's weights came with the handover
                module.load_state_dict(self._handover.module_weights())
            else:
                replicas.prepare_module(self.transport, module)
            self._optimizers = []  # a new training: the optimizers set up next are its own
            bound = self._core.bind(module)
            self._module = module
            bound.on_train_start()
            collectives.connect_metrics(
                module, lambda: self._core.healing.distributed(self.world_size), self._metric_allgather
            )
            return module

        @override
        def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
            self._optimizers.append(optimizer)
            self._core.aids.announce(self.world_size, self._optimizers)
            # a sharded optimizer (shard_optimizer=True) is rebuilt over this rank's shard here
            self._core.optimizer_sharding.attach(self._core.bound_rule, [optimizer])
            self._core.optimizer_sharding.check_precision(self.precision)
            return optimizer

        @override
        def setup_module_and_optimizers(
            self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
        ) -> Any:
            module = self.setup_module(module)
            optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
            return module, optimizers, scheduler

        # -- a step ----------------------------------------------------------------------------------------
        @override
        @_fails_the_run
        def backward(self, tensor: Any, module: Module | None, *args: Any, **kwargs: Any) -> None:
            super().backward(tensor, module, *args, **kwargs)

        @override
        @_fails_the_run
        def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
            """The rule's exchange (``before_step``), the update, then ``after_step``.

            The convergence aids (``lr_scaling``) change the param groups for the update only.
            """
            # A GradScaler already skips steps with inf gradients and lowers its scale: it must see them.
            return self._step.run(
                optimizer,
                self._module,
                lambda: self.world_size,
                lambda: super(MPIStrategy, self).optimizer_step(optimizer, **kwargs),
                scaler_handles_inf=getattr(self.precision, "scaler", None) is not None,
            )

        def _adopt_healed_run(self, state: dict[str, Any] | None) -> None:
            """After a heal (collective over the survivors): ranks and world size as the healed run
            has them (``fabric.world_size``, ``fabric.global_rank``), the rule bound again on the new
            transport with ``state``. The loop's loaders keep their shards: call
            ``fabric.setup_dataloaders`` again at the next epoch to shard over the survivors."""
            self._set_world_ranks()
            self._handover.warn_if_never_let_in(self.world_size)
            self._core.rebind(state, self._module, self._optimizers)

        @override
        @_fails_the_run
        def clip_gradients_norm(
            self,
            module: Module,
            optimizer: Optimizer,
            max_norm: float,
            norm_type: float = 2.0,
            error_if_nonfinite: bool = True,
        ) -> torch.Tensor:
            """Fabric's clipping, after the exchange; a sharded optimizer clips by the global norm over
            the shards."""
            self._step.exchange_before_clipping(optimizer, self._module)
            if not self._core.optimizer_sharding.owns(optimizer):
                norm: torch.Tensor = super().clip_gradients_norm(
                    module, optimizer, max_norm, norm_type, error_if_nonfinite
                )
                return norm
            self.precision.unscale_gradients(optimizer)
            return self._core.optimizer_sharding.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

        @override
        @_fails_the_run
        def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
            """Fabric's clipping by value, after the exchange (element-wise: shards clip alike)."""
            self._step.exchange_before_clipping(optimizer, self._module)
            super().clip_gradients_value(module, optimizer, clip_val)

        @_fails_the_run
        def finish_training(self) -> None:
            """End training on every rank: leave the rule's consensus weights in the module (the center,
            the average, the gossip consensus) and release its threads and windows.

            Call it once, on every rank, after the training loop and before evaluating or saving the
            final model (it may be collective). A save after it holds the state the rule ended with
            (a sharded optimizer stays sharded: its save is a directory of shards, as during
            training). A later ``fabric.setup`` binds the rule afresh. Calling it again does nothing.
            """
            core = self._core
            if core.bound_rule is None:
                return
            core.end_training()  # a heal may rebind the rule
            # saves after it still hold the rule's state as it ended, and a sharded optimizer's shards
            core.runner.end()

        @override
        def teardown(self) -> None:
            self._core.runner.close()
            super().teardown()

        # -- collectives (over MPI: see :mod:`..run_collectives`) ----------------------------------------------
        @override
        @_fails_the_run
        def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
            return self._core.collectives.reduce(tensor, group, reduce_op, name="all_reduce")

        @override
        @_fails_the_run
        def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
            return self._core.collectives.all_gather(tensor, group, sync_grads)

        @override
        @_fails_the_run
        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return self._core.collectives.broadcast(obj, src)

        @_fails_the_run
        def _metric_allgather(self, obj: Any) -> list[Any]:
            """torchmetrics' sync (:func:`..collectives.connect_metrics`): every rank's ``obj``."""
            return self._core.collectives.allgather_object(obj)

        @override
        @_fails_the_run
        def barrier(self, name: str | None = None) -> None:
            self._core.collectives.barrier()

        # -- checkpoints -----------------------------------------------------------------------------------
        @override
        @_fails_the_run
        def save_checkpoint(
            self,
            path: Any,
            state: dict[str, Any],
            storage_options: Any | None = None,
            filter: dict[str, Any] | None = None,
        ) -> None:
            """Rank 0 writes ``state`` plus the rule's state; every rank takes part (sharded rule
            state is gathered here). After :meth:`finish_training` the file holds the consensus
            weights and the state the rule ended with. With a sharded optimizer (``mpi_zero``) the
            file is a directory that every rank writes its shard into, before and after
            :meth:`finish_training` alike. Under ``heal`` a rank lost during the save makes the
            survivors heal and save again (:func:`..checkpoint_io.save_through_heals`)."""
            self._checkpoints.save(
                path,
                state,
                filter,
                lambda full: super(MPIStrategy, self).save_checkpoint(
                    path, full, storage_options=storage_options, filter=filter
                ),
            )

        @override
        def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
            """This rank's shard when the optimizer is sharded, else Fabric's."""
            return self._core.optimizer_state(
                optimizer, lambda: super(MPIStrategy, self).get_optimizer_state(optimizer)
            )

        @override
        @_fails_the_run
        def load_checkpoint(
            self, path: Any, state: Any | None = None, strict: bool = True, weights_only: bool | None = None
        ) -> dict[str, Any]:
            """Fabric's load, and the rule's state restored from the ``"lightning_mpi"`` entry.

            With ``state`` a dictionary (or ``None``) the rule's state comes back too; loading into a
            bare module or optimizer restores only that object. A file without the rule's state that
            replaces the weights of the module set up with this strategy binds the rule afresh on
            them (:mod:`.checkpoints`). The file holds the rule's own objects, so it is read with
            ``weights_only=False`` unless you say otherwise.
            """
            return self._checkpoints.load(
                path,
                state,
                lambda rest: super(MPIStrategy, self).load_checkpoint(
                    path, state=rest, strict=strict, weights_only=False if weights_only is None else weights_only
                ),
            )

    document_frontend(MPIStrategy, FABRIC_ARGUMENTS)
    return MPIStrategy
