"""The Trainer strategy: what happens over MPI at setup, every step, at checkpoints and at teardown.

:func:`trainer_strategy` defines ``MPIStrategy`` on the ``ParallelStrategy`` of one Trainer package
(``pytorch_lightning`` or ``lightning.pytorch``: :mod:`..build` calls it once per package). Every
Lightning method it overrides has one job and calls the collaborator that does it:

================================  ========================================================
collaborator                      its job
================================  ========================================================
:class:`..core.StrategyCore`       what both frontends share: the options, the rule runner, failures,
                                  healing, replacements, ZeRO's optimizer shard, the collectives,
                                  the convergence aids, and what the user reads and sets
:mod:`..replicas`                  the same model and rank 0's weights on every rank
:class:`..decisions.StopDecisions`  stop decisions without barriers (asynchronous rules)
:class:`..preemption.PreemptionWatch`  a consistent checkpoint on SIGTERM/SIGUSR1, exit 0
:func:`.launch.trainer_launcher`  each stage run here; ``fit`` resumes by itself after a restart
:class:`..sharding.LoaderSharding`  every loader sharded over the ranks
:class:`.step.TrainerStep`  backward, the rule's exchange, the update, ``after_step``
:class:`.checkpoints.TrainerCheckpoints`  the rule's state in checkpoints, sharded saves, handovers
================================  ========================================================

The lifecycle, top to bottom:

- construction: the options are checked, MPI's ranks and nodes become the cluster environment
  (:class:`..core.StrategyCore`);
- ``setup``: the model on this rank's device, the same model and rank 0's weights everywhere, the
  rule bound to the trainable parameters (when fitting);
- ``on_train_start``: the rule starts, the aids say what they do, the preemption vote starts;
- every batch: another rank's failure or a preemption vote stops this rank;
- ``optimizer_step``: backward runs inside Lightning's closure, so the closure is wrapped: after
  backward the rule exchanges (``before_step``), and a rejected exchange skips the update on every
  rank; then ``after_step``. Lightning calls it only on steps that update, so gradient
  accumulation exchanges once per update;
- ``save_checkpoint`` / ``load_checkpoint``: the rule's state travels under ``"lightning_mpi"``;
- ``on_train_end``: the rule leaves its consensus weights in the module;
- ``on_exception``: the run fails on every rank (other ranks raise ``RankFailedError``);
- ``teardown``: the rule's threads and windows are released.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies import collectives, replicas
from lightning_mpi.strategies.core import CoreAttribute, StrategyCore
from lightning_mpi.strategies.decisions import StopDecisions
from lightning_mpi.strategies.lightning_api import TrainerAPI
from lightning_mpi.strategies.preemption import PreemptionWatch
from lightning_mpi.strategies.replacement import LoopAccess
from lightning_mpi.strategies.sharding import LoaderSharding
from lightning_mpi.strategies.signatures import document_frontend
from lightning_mpi.strategies.trainer.checkpoints import TrainerCheckpoints, handover_checkpoint
from lightning_mpi.strategies.trainer.launch import trainer_launcher
from lightning_mpi.strategies.trainer.step import TrainerStep

#: ``heal="replace"``: what the survivors hand a new rank at a batch's start, Lightning's own
#: checkpoint dictionary of that moment, and where the epoch is (a new rank skips those batches)
TRAINER_LOOP = LoopAccess(
    snapshot=handover_checkpoint,
    step=lambda trainer: int(trainer.global_step),
    batches_done=lambda trainer: int(trainer.fit_loop.epoch_loop.batch_progress.current.completed),
)

#: The Trainer strategy's own arguments (beside the common options), documented once.
TRAINER_ARGUMENTS = {
    "rule": "what to exchange and when (a lightning_mpi `Rule`); None is `SyncRule()`: average gradients with one "
    "Allreduce every step. The named strategies build it from their arguments.",
    "log_stats": "log the rule's per-step numbers (exchange time, bytes, skipped steps, ...) and the convergence "
    "aids' values to the trainer's loggers under `mpi/`.",
    "accelerator": "as for any Lightning strategy; normally left to the Trainer.",
    "checkpoint_io": "as for any Lightning strategy; by default checkpoint files are written atomically.",
    "precision_plugin": "as for any Lightning strategy; normally left to the Trainer.",
}


def trainer_strategy(api: TrainerAPI, environment_class: type, checkpoint_io_class: type) -> type:
    """``MPIStrategy`` on Trainer package ``api``'s ``ParallelStrategy`` (see the module docstring).

    ``environment_class`` and ``checkpoint_io_class`` are the MPI cluster environment and the
    atomic checkpoint IO on the same package's Fabric.
    """
    base: Any = api.ParallelStrategy  # a class of the package the user imported: known at run time only

    class MPIStrategy(base):
        """Data-parallel training over MPI with an exchange rule, for the Lightning Trainer.

        Ranks come from ``MPI.COMM_WORLD``: launch with ``mpiexec -n N python train.py`` (or the
        ``lightning-mpi`` launcher); plain ``python train.py`` is world size 1. Devices need no
        bookkeeping: rank ``r`` uses accelerator device ``local_rank % devices_on_this_host``.
        """

        # Lightning's properties, declared for the type checker only (the base is known at run time)
        model: Any
        parallel_devices: list[torch.device] | None

        def __init__(
            self,
            rule: Rule | None = None,
            log_stats: bool = True,
            accelerator: Any | None = None,
            checkpoint_io: Any | None = None,
            precision_plugin: Any | None = None,
            **options: Any,
        ) -> None:
            self._sharding = LoaderSharding(api)
            self._core = StrategyCore(
                rule, options, api.fabric, environment_class, self._adopt_healed_run, TRAINER_LOOP, self._sharding
            )
            super().__init__(
                accelerator=accelerator,
                parallel_devices=None,
                cluster_environment=self._core.environment,
                checkpoint_io=checkpoint_io if checkpoint_io is not None else checkpoint_io_class(),
                precision_plugin=precision_plugin,
            )
            self.log_stats = log_stats
            self._decisions = StopDecisions(api.Callback)
            self._preemption = PreemptionWatch()
            core = self._core
            self._step = TrainerStep(core.runner, core.healing, core.failures, core.aids)
            self._checkpoints = TrainerCheckpoints(self, core, api.fabric.optimizers_to_device)
            core.replacing.join()  # a process spawned to replace a lost rank joins the run here
            self.set_world_ranks()

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

        def stats(self) -> dict[str, float]:
            """What ``log_stats`` logs: the rule's numbers for the last step (``mpi/<rule>/...``, world
            size > 1) and the convergence aids' values (``mpi/lr_scale``, ``mpi/momentum_*``)."""
            return self._core.stats()

        def propagate_errors(self) -> AbstractContextManager[None]:
            """An exception inside fails the run on every rank (see :mod:`..failures`)."""
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

        @num_nodes.setter
        def num_nodes(self, value: int) -> None:
            # The Trainer assigns its num_nodes flag; MPI decides, and a flag that contradicts it is refused.
            self._core.refuse_num_nodes(value)

        @property
        @override
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        @property
        @override
        def is_distributed(self) -> bool:
            return self._core.healing.distributed(self.world_size)

        def set_world_ranks(self) -> None:
            # Lightning has set parallel_devices from devices= by now: refuse one that MPI contradicts,
            # and keep one device per rank on this host (so trainer.num_devices is true).
            self.parallel_devices = self._core.devices(self.parallel_devices, self.accelerator)
            # Lightning decides "rank zero only" output (progress bar, model summary, warnings) from these.
            api.rank_zero_only.rank = api.fabric.rank_zero_only.rank = self.global_rank

        @override
        def _configure_launcher(self) -> None:
            # every stage inside propagate_errors; fit resumed after a restart, or from a replacement's handover
            self._launcher = trainer_launcher(self, self._core.failures, self._core.replacing, api.TrainerFn.FITTING)

        @override
        def setup_environment(self) -> None:
            super().setup_environment()
            self._core.abort_when_uncaught()

        # -- setup -----------------------------------------------------------------------------------------
        @override
        def setup(self, trainer: Any) -> None:
            self._sharding.take_over(trainer)  # before Lightning builds this stage's loaders
            assert self.accelerator is not None and self.model is not None
            self.accelerator.setup(trainer)
            model: torch.nn.Module = self.precision_plugin.convert_module(self.model)
            self.model = model
            self.model_to_device()
            if not self._core.replacing.catching_up:  # a replacement has the survivors' weights already
                replicas.prepare_module(self.transport, model)
            fitting = trainer.state.fn == api.TrainerFn.FITTING
            if fitting:
                self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            if fitting:
                api.fabric.optimizers_to_device(self.optimizers, self.root_device)
                optimizer_sharding = self._core.optimizer_sharding
                # shard_optimizer: the optimizer rebuilt over this rank's shard, before any state loads
                optimizer_sharding.attach(self._core.bind(model), self.optimizers)
                optimizer_sharding.check_precision(self.precision_plugin)
                if optimizer_sharding.active:
                    # Lightning clips through the precision plugin: by the global norm over the shards
                    self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm
            collectives.connect_metrics(model, lambda: self.is_distributed, self._metric_allgather)

        def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
            self._core.optimizer_sharding.clip_grad_norm_(clip_val)

        @override
        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        @override
        def process_dataloader(self, dataloader: Any) -> Any:
            dataloader = super().process_dataloader(dataloader)
            trainer = getattr(self.lightning_module, "_trainer", None)
            return self._sharding.shard(dataloader, trainer, self.world_size, self.global_rank)

        # -- training --------------------------------------------------------------------------------------
        @override
        def on_train_start(self) -> None:
            super().on_train_start()
            bound = self._core.bound_rule
            if bound is not None:
                bound.on_train_start()
            self._core.aids.announce(self.world_size, self.optimizers)
            self._decisions.ended = False
            if self._core.replacing.catching_up:  # a rank let in: the survivors agree on a stop here too
                self._decisions.agree_after_heal(self.transport, self._core.collectives.count, joining=True)
            # Asynchronous rules must not wait for the vote; their checkpoint decisions stay collective.
            self._preemption.start(self.transport, lockstep=not self.rule.asynchronous)
            if self.rule.asynchronous:
                self._decisions.scope_checkpoint_hooks(self.lightning_module.trainer)

        @override
        def batch_to_device(self, batch: Any, device: Any | None = None, dataloader_idx: int = 0) -> Any:
            # every batch of every loop: stop within a batch of another rank's failure (or heal)
            self._core.check_peers()
            return super().batch_to_device(batch, device, dataloader_idx)

        @override
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            super().on_train_batch_start(batch, batch_idx)
            trainer = self.lightning_module.trainer
            self._sharding.at_training_batch(trainer)  # loaders a heal left in use or being set up
            self._core.replacing.at_batch_start(trainer)  # heal="replace": new ranks join here
            if self._core.healing.between("the preemption vote", self._preemption.requested, False):
                self._preempt()

        @override
        @contextmanager
        def block_backward_sync(self) -> Generator[None, None, None]:
            """Lightning wraps backward in this while it accumulates gradients."""
            with self._core.runner.paused():
                yield

        @override
        def optimizer_step(
            self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
        ) -> Any:
            # A GradScaler (16-mixed) already skips steps with inf gradients and lowers its scale: it must see them.
            output = self._step.run(
                optimizer,
                closure,
                lambda wrapped: super(MPIStrategy, self).optimizer_step(optimizer, wrapped, model, **kwargs),
                self.model,
                lambda: self.world_size,
                self._optimizer_step_count,
                scaler_handles_inf=getattr(self.precision_plugin, "scaler", None) is not None,
            )
            self._log_stats()
            return output

        def _optimizer_step_count(self) -> int:
            trainer = getattr(self._lightning_module, "_trainer", None) if self._lightning_module is not None else None
            return int(trainer.global_step) if trainer is not None else self._step.steps_seen

        def _log_stats(self) -> None:
            """Rank 0 logs :meth:`stats` every ``log_every_n_steps``."""
            trainer = getattr(self.lightning_module, "_trainer", None)
            if not self.log_stats or trainer is None or not trainer.loggers:
                return
            if (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) != 0:
                return
            metrics = self.stats()
            if metrics and self.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)

        def _adopt_healed_run(self, state: dict[str, Any] | None) -> None:
            """After a heal (collective over the survivors): Lightning's ranks, the rule bound again
            on the new transport with ``state``, the vote restarted, the loaders sharded anew from
            the next epoch (see :mod:`..healing`), unless a survivor had ended training: a survivor
            still training (an asynchronous rule's) then keeps its loaders, since loading them again
            is collective (a barrier, a reduce of their lengths) and the other never loads them."""
            self.set_world_ranks()
            self._core.rebind(state, self.model, self.optimizers)
            # a stop some survivor learned holds for all (with the ranks let in: at their on_train_start)
            ended = self._decisions.agree_after_heal(self.transport, self._core.collectives.count)
            self._preemption.restart(self.transport)
            trainer = getattr(self.lightning_module, "_trainer", None) if self._lightning_module is not None else None
            if trainer is not None and not ended:
                self._sharding.reshard_next_epoch(trainer)

        @override
        def on_train_end(self) -> None:
            # drains the votes: a signal at the last batch counts. A heal during the drain restarts
            # the votes over the survivors, and each drains the new ones: a survivor that healed
            # elsewhere (still training, under an asynchronous rule) drains them at its own end
            self._decisions.ended = True
            stop = None
            while stop is None:
                stop = self._core.healing.between("the preemption vote", self._preemption.requested_at_end, None)
            if stop:
                self._preempt()
            self._preemption.stop()
            self._core.end_training()  # collective for asynchronous rules: every rank is here
            super().on_train_end()

        def _preempt(self) -> None:
            """Every rank writes the preemption checkpoint and stops (raises ``Preempted``)."""
            bound = self._core.bound_rule
            self._preemption.checkpoint_and_exit(
                self.lightning_module.trainer,
                self.global_rank,
                self._decisions.collective_decisions,
                end_training=bound.on_train_end if bound is not None else (lambda: None),
            )

        @override
        def on_exception(self, exception: BaseException) -> None:
            """Fail the run on every rank (see :mod:`..failures`) if the launcher has not already: post
            the exception, abandon the run. A preemption stop is no failure. Loggers are finalised by
            Lightning right after."""
            self._preemption.stop()
            super().on_exception(exception)
            self._core.failures.fail_run(exception)

        @override
        def teardown(self) -> None:
            self._decisions.unscope_hooks()
            self._core.runner.close()
            self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)  # Lightning's own again
            # a sharded optimizer stays sharded: a save after fit writes its shards, as one during fit
            super().teardown()

        # -- collectives (over MPI: see :mod:`..run_collectives`), and Lightning's stop decisions ----------
        @override
        def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
            return self._core.collectives.reduce(tensor, group, reduce_op)

        @override
        def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
            return self._core.collectives.all_gather(tensor, group, sync_grads)

        def _metric_allgather(self, obj: Any) -> list[Any]:
            """torchmetrics' sync (:func:`..collectives.connect_metrics`): every rank's ``obj``."""
            return self._core.collectives.allgather_object(obj)

        @override
        def barrier(self, name: str | None = None) -> None:
            self._core.collectives.barrier()

        @override
        def broadcast(self, obj: Any, src: int = 0) -> Any:
            """A bool (a stop decision) is published on the rule's board while an asynchronous rule
            trains (no barrier: see :mod:`..decisions`); anything else is a collective."""
            board = self._decision_board() if isinstance(obj, bool) else None
            if board is not None:
                return self._decisions.broadcast(board, obj, src, self._core.collectives.count)
            return self._core.collectives.broadcast(obj, src)

        @override
        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            board = self._decision_board()
            if board is not None:
                return self._decisions.reduce(board, bool(decision), all, self._core.collectives.count)
            return bool(super().reduce_boolean_decision(decision, all))

        def _decision_board(self) -> Any | None:
            if self._decisions.board(self._core.bound_rule) is None:
                return None
            # a board read waits for no rank: look for a failure first (under heal, heal here; the
            # healed run's rule has a board of its own)
            self._core.check_peers()
            return self._decisions.board(self._core.bound_rule)

        def collective_decisions(self) -> AbstractContextManager[None]:
            """A scope in which every decision is a collective (see :mod:`..decisions`)."""
            return self._decisions.collective_decisions()

        # -- checkpoints -----------------------------------------------------------------------------------
        @override
        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
        ) -> None:
            """Rank 0 writes; the rule's state (center, clocks, ...) is added to the checkpoint first.

            Called on every rank, so a rule with sharded state may gather it here. With a sharded
            optimizer (``mpi_zero``) ``filepath`` is a directory that every rank writes its shard into.
            Under ``heal`` a rank lost during the save (rank 0 in its write included) makes the
            survivors heal and save again (:func:`..checkpoint_io.save_through_heals`).
            """
            self._checkpoints.save(
                checkpoint,
                filepath,
                lambda: super(MPIStrategy, self).save_checkpoint(checkpoint, filepath, storage_options),
            )

        @override
        def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
            """This rank's shard when the optimizer is sharded, else Lightning's."""
            return self._core.optimizer_state(optimizer, lambda: super(MPIStrategy, self).optimizer_state(optimizer))

        @override
        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            """Each optimizer's saved state; a sharded optimizer takes a sharded save at any world size."""
            self._checkpoints.load_optimizer_states(checkpoint)

        @override
        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            """Every rank reads the checkpoint; the rule's state is restored when the rule is bound.
            The file holds the rule's own objects, so it is read with ``weights_only=False`` unless
            you say otherwise."""
            return self._checkpoints.load(
                checkpoint_path,
                lambda: super(MPIStrategy, self).load_checkpoint(
                    checkpoint_path, weights_only=False if weights_only is None else weights_only
                ),
            )

    document_frontend(MPIStrategy, TRAINER_ARGUMENTS)
    return MPIStrategy
