"""The Trainer frontend: Lightning's lifecycle calls the rule's hooks here.

:class:`TrainerMPIStrategy` is mixed into the ``ParallelStrategy`` of each Trainer package
(``pytorch_lightning``, ``lightning.pytorch``) by :mod:`lightning_mpi.strategies.build`; the class
attributes ``_api`` and ``_fabric_api`` name that package's classes. Each method has one job:

- ``setup``: the model on its device, every rank on rank 0's weights, the rule bound to the
  trainable parameters.
- ``optimizer_step``: backward runs inside Lightning's closure, so the closure is wrapped: after
  backward the rule exchanges (``before_step``); a rejected exchange skips the step on every rank.
  Lightning calls ``optimizer_step`` only on steps that update, so gradient accumulation
  exchanges once per update. Then ``after_step``.
- ``on_train_end``: the rule leaves its consensus weights in the module.
- ``fit``/``validate``/``test``/``predict`` run inside :meth:`~.failures.FailurePropagation.propagate_errors`
  (through a launcher that runs them in this process): an exception on one rank is posted to the
  others, which raise ``RankFailedError``, and the run is abandoned before Lightning's exception
  hooks run; ``on_exception`` does the same for an exception raised outside it.
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, Optional

from torch.optim import Optimizer

from lightning_mpi.lr_scaling import StepOverrides
from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies.aids import ConvergenceAids
from lightning_mpi.strategies.core import CHECKPOINT_KEY, MPIStrategyCore
from lightning_mpi.strategies.failures import install_abort_hook
from lightning_mpi.strategies.flags import check_num_nodes, checked_parallel_devices  # issue 27: devices=/num_nodes= against MPI


class _InProcessLauncher:
    """Lightning's launcher slot, used to run ``fit``/``validate``/``test``/``predict`` inside
    :meth:`~.failures.FailurePropagation.propagate_errors` in this process (``mpiexec`` started the
    ranks): a failure is posted before Lightning's ``on_exception`` hooks run, so that callbacks
    that make collectives there (a checkpoint on exception) start on fresh communicators everywhere."""

    is_interactive_compatible = True

    def __init__(self, strategy: "TrainerMPIStrategy") -> None:
        self._strategy = strategy

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        with self._strategy.propagate_errors():
            return function(*args, **kwargs)

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher starts no process."""


class _SkipStep(Exception):
    """Raised from inside the optimizer closure to abandon a step before the update runs."""


class TrainerMPIStrategy(ConvergenceAids, MPIStrategyCore):
    """Data-parallel training over MPI with an exchange rule.

    Args:
        rule: what to exchange and when; defaults to :class:`~lightning_mpi.rules.sync.SyncRule`
            (average gradients with one Allreduce every step).
        log_stats: log the rule's per-step numbers (exchange time, bytes, skips) to the trainer's
            loggers under ``mpi/``.
        abort_on_exception: ``False`` (default): an exception on one rank inside
            ``fit``/``validate``/``test``/``predict`` propagates there, and every other rank raises
            :class:`~lightning_mpi.RankFailedError` naming it within seconds, so ``try: trainer.fit(...)``
            works as with one process; only an exception that nobody catches ends every rank
            (``MPI_Abort`` from ``sys.excepthook``). ``True``: the failing rank prints its
            traceback and calls ``MPI_Abort`` at once (world size > 1 only).
        collective_timeout: seconds any collective may wait for the other ranks before it raises
            ``CollectiveTimeout``; ``None`` waits forever. A rank that hung outside any
            collective, or ranks that run different numbers of steps, are caught this way (a rank
            that raised is caught at once, see ``abort_on_exception``).
        lr_scaling: ``"linear"`` multiplies every learning rate by the world size W, ``"sqrt"`` by
            √W (Goyal et al. 2017); ``None`` (default) leaves them alone. Applied to the update
            only: ``training_step``, LR schedulers, ``LearningRateMonitor`` and checkpoints see
            your unscaled values (``on_before_optimizer_step`` sees the scaled ones). Rank 0 prints
            what it does at train start, and the factor is logged as ``mpi/lr_scale``. Goyal's
            rule is for averaged gradients; DOWNPOUR and EAMSGD already move the center about W×
            per epoch (see :mod:`lightning_mpi.rules.server`).
        warmup_steps: gradual warm-up of that factor: from x1 at optimizer step 0 linearly to the
            full factor at this step (0 = no warm-up). Counted in optimizer steps (``global_step``),
            so it resumes where a checkpoint left off.
        accelerator, checkpoint_io, precision_plugin: as for any Lightning strategy; normally
            left to the ``Trainer``.

    Subclasses take these (``log_stats`` onwards) as keyword arguments and pass them on.

    Ranks come from ``MPI.COMM_WORLD``: launch with ``mpiexec -n N python train.py`` (or the
    ``lightning-mpi`` launcher); plain ``python train.py`` is world size 1. Devices need no
    bookkeeping: rank ``r`` uses accelerator device ``local_rank % devices_on_this_host``.
    """

    _api: Any  # TrainerAPI of the package this class is built on
    _fabric_api: Any

    def __init__(
        self,
        rule: Optional[Rule] = None,
        log_stats: bool = True,
        abort_on_exception: bool = False,
        collective_timeout: Optional[float] = 1800.0,
        lr_scaling: Optional[Literal["linear", "sqrt"]] = None,
        warmup_steps: int = 0,
        accelerator: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        placement = self._placement(rule, collective_timeout, lr_scaling, warmup_steps, checkpoint_io)
        # the package's ParallelStrategy
        super().__init__(accelerator=accelerator, precision_plugin=precision_plugin, **placement)  # type: ignore[call-arg]
        self._init_core(rule, placement["cluster_environment"].comm, collective_timeout)
        self._init_aids(lr_scaling, warmup_steps)
        self.log_stats = log_stats
        self.abort_on_exception = abort_on_exception
        self._steps_seen = 0  # optimizer steps without a trainer to count them
        self.set_world_ranks()

    # -- where this rank lives -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self.cluster_environment.num_nodes  # type: ignore[attr-defined]

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        # The Trainer assigns its num_nodes flag; MPI knows better, so the flag is ignored.
        check_num_nodes(value, self.cluster_environment)  # issue 27: refuse a num_nodes= that MPI contradicts

    def set_world_ranks(self) -> None:
        self.parallel_devices = checked_parallel_devices(self.parallel_devices, self.accelerator, self.cluster_environment)  # issue 27: refuse a devices= that MPI contradicts; one device per local rank
        # Lightning decides "rank zero only" output (progress bar, model summary, warnings) from these.
        self._api.rank_zero_only.rank = self._fabric_api.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def _configure_launcher(self) -> None:
        self._launcher = _InProcessLauncher(self)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if self.world_size > 1:
            install_abort_hook(self.global_rank, self.world_size)

    def batch_to_device(self, batch: Any, device: Optional[Any] = None, dataloader_idx: int = 0) -> Any:
        self.check_peers()  # every batch of every loop: stop within a batch of another rank's failure
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    # -- setup -------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None  # type: ignore[attr-defined]
        self.accelerator.setup(trainer)  # type: ignore[attr-defined]
        self.model = self.precision_plugin.convert_module(self.model)  # type: ignore[attr-defined]
        self.model_to_device()
        self.prepare_module(self.model)
        fitting = trainer.state.fn == self._api.TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # type: ignore[attr-defined]
        self.setup_precision_plugin()  # type: ignore[attr-defined]
        if fitting:
            self._fabric_api.optimizers_to_device(self.optimizers, self.root_device)  # type: ignore[attr-defined]
            self.bind_rule(self.model)
        self.connect_metrics(self.model)

    def model_to_device(self) -> None:
        assert self.model is not None  # type: ignore[attr-defined]
        self.model.to(self.root_device)  # type: ignore[attr-defined]

    # -- training ----------------------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps backward in this while it accumulates gradients."""
        with self.exchanges_paused():
            yield

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if self._bound is not None:
            self._bound.on_train_start()
        self._announce_convergence_aids()

    def _optimizer_step_count(self) -> int:
        trainer = getattr(self._lightning_module, "_trainer", None) if self._lightning_module is not None else None  # type: ignore[attr-defined]
        return int(trainer.global_step) if trainer is not None else self._steps_seen

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Optional[Any] = None,
                       **kwargs: Any) -> Any:
        # The aids wrap the whole ``optimizer.step`` (LBFGS reads its lr before it calls the
        # closure) and are lifted while the closure runs (SGD/Adam call it first, then read the lr),
        # so only the update sees them; ``with`` puts the user's values back on every exit: a
        # finished step, a skipped one (``_SkipStep``) or an exception.
        self.check_peers()
        overrides = self._step_overrides(optimizer)
        try:
            with overrides if overrides is not None else nullcontext():
                output = self._exchange_and_step(optimizer, closure, overrides, model, **kwargs)
        finally:
            self._steps_seen += 1
        if overrides is not None:
            self._record_aid_stats(overrides)
        self._log_rule_stats()
        return output

    def _exchange_and_step(self, optimizer: Optimizer, closure: Callable[[], Any], overrides: Optional[StepOverrides],
                           model: Optional[Any] = None, **kwargs: Any) -> Any:
        """Backward (the closure), the rule's exchange, the update, the rule's ``after_step``."""
        lift = overrides.wrap_closure if overrides is not None else (lambda f: f)
        bound = self._bound
        if bound is None:
            return super().optimizer_step(optimizer, lift(closure), model, **kwargs)  # type: ignore[misc]
        # A GradScaler (16-mixed) already skips steps with inf gradients and lowers its scale; it
        # must see them, so with a scaler the step is not abandoned here.
        scaler_handles_inf = getattr(self.precision_plugin, "scaler", None) is not None  # type: ignore[attr-defined]

        def closure_then_exchange() -> Any:
            result = closure()
            if not bound.before_step(optimizer) and not scaler_handles_inf:
                raise _SkipStep
            return result

        try:
            # backward and the exchange see the user's values; the update sees the aids
            output = super().optimizer_step(optimizer, lift(closure_then_exchange), model, **kwargs)  # type: ignore[misc]
        except _SkipStep:
            output = None
        else:
            bound.after_step(optimizer)
        return output

    def _log_rule_stats(self) -> None:
        """Rank 0 logs the rule's numbers (world size > 1) and the convergence aids' values."""
        if not self.log_stats:
            return
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if trainer is None or not trainer.loggers:
            return
        if (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        metrics: dict[str, float] = {}
        if self._bound is not None and self.world_size > 1:
            metrics.update({f"mpi/{self.rule.name}/{k}": v for k, v in self._bound.stats().items()})
        metrics.update(self._aid_stats)
        if metrics and self.is_global_zero:  # type: ignore[attr-defined]
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self) -> None:
        if self._bound is not None:
            self._bound.on_train_end()
        super().on_train_end()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        """Fail the run on every rank (see :mod:`.failures`) if the launcher has not already: post the
        exception, abandon the run. Loggers are finalised by Lightning right after."""
        super().on_exception(exception)  # type: ignore[misc]
        self.fail_run(exception)

    def teardown(self) -> None:
        self.close_rule()
        super().teardown()  # type: ignore[misc]

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Rank 0 writes; the rule's state (center, clocks, ...) is added to the checkpoint first.

        Called on every rank, so a rule with sharded state may gather it here.
        """
        entry = self.rule_checkpoint()
        if entry is not None:
            checkpoint[CHECKPOINT_KEY] = entry
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Every rank reads the checkpoint; the rule's state is restored when the rule is bound."""
        checkpoint = super().load_checkpoint(  # type: ignore[misc]
            checkpoint_path, weights_only=False if weights_only is None else weights_only
        )
        self.restore_rule(checkpoint.get(CHECKPOINT_KEY))
        return checkpoint
