"""Lightning meets a rule here, and only here.

:class:`MPIStrategy` is a Lightning :class:`~pytorch_lightning.strategies.ParallelStrategy` whose
ranks, nodes and local ranks come from MPI and whose collectives (``reduce``, ``all_gather``,
``broadcast``, ``barrier``) go over MPI, so no ``torch.distributed`` process group is created. The
"when and what" of the exchange is a :class:`~lightning_mpi.rules.base.Rule`; this class calls its
hooks at the right points of Lightning's lifecycle:

- ``setup``: broadcast rank 0's parameters and buffers, bind the rule to the trainable parameters.
- ``optimizer_step``: backward runs inside Lightning's closure, so the closure is wrapped: after
  backward the rule exchanges (``before_step``); a rejected exchange skips the step on every rank.
  Lightning calls ``optimizer_step`` only on steps that update, so gradient accumulation
  exchanges once per update. Then ``after_step``. The opt-in convergence aids
  (``lr_scaling``/``warmup_steps``, and ``momentum_correction`` on the asynchronous strategies,
  see :mod:`lightning_mpi.lr_scaling`) change the param groups for the update only.
- ``on_train_end``: the rule leaves its consensus weights in the module.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, Optional, Union

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from pytorch_lightning.plugins import CheckpointIO, Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.checkpoint_io import AtomicCheckpointIO
from lightning_mpi.comm.transport import Transport
from lightning_mpi.environment import MPIClusterEnvironment
from lightning_mpi.lr_scaling import StepOverrides, check_lr_scaling, check_warmup_steps, describe_lr_scaling, lr_factor
from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.sync import SyncRule

log = logging.getLogger(__name__)

#: Pause between printing a failing rank's traceback and ``MPI_Abort`` (see ``on_exception``).
ABORT_FLUSH_SECONDS = 0.5


class _SkipStep(Exception):
    """Raised from inside the optimizer closure to abandon a step before the update runs."""


def _reduce_op_name(reduce_op: Any) -> str:
    """Map Lightning/torch reduce ops ("mean", "avg", "sum", ReduceOp.SUM, ...) to a short name."""
    name = str(getattr(reduce_op, "name", reduce_op) if reduce_op is not None else "mean").lower()
    name = name.rsplit(".", 1)[-1]
    aliases = {"avg": "mean", "mean": "mean", "sum": "sum", "max": "max", "min": "min", "product": "prod", "prod": "prod"}
    if name not in aliases:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported: use one of 'mean', 'sum', 'max', 'min', 'prod'")
    return aliases[name]


class MPIStrategy(ParallelStrategy):
    """Data-parallel training over MPI with an exchange rule.

    Args:
        rule: what to exchange and when; defaults to :class:`~lightning_mpi.rules.sync.SyncRule`
            (average gradients with one Allreduce every step).
        log_stats: log the rule's per-step numbers (exchange time, bytes, skips) to the trainer's
            loggers under ``mpi/``.
        abort_on_exception: when an exception escapes ``fit``/``validate``/``test`` on one rank,
            print its traceback and call ``MPI_Abort`` so that every rank exits non-zero at once
            instead of waiting forever in a collective (world size > 1 only).
        collective_timeout: seconds any collective may wait for the other ranks before it raises
            ``CollectiveTimeout`` (which, with ``abort_on_exception``, ends the job with a clear
            message); ``None`` waits forever. A rank that died or hung, or ranks that run
            different numbers of steps, are caught this way.
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

    strategy_name = "mpi"

    def __init__(
        self,
        rule: Optional[Rule] = None,
        log_stats: bool = True,
        abort_on_exception: bool = True,
        collective_timeout: Optional[float] = 1800.0,
        lr_scaling: Optional[Literal["linear", "sqrt"]] = None,
        warmup_steps: int = 0,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        check_lr_scaling(lr_scaling)
        check_warmup_steps(warmup_steps)
        if rule is not None and not isinstance(rule, Rule):
            raise ValueError(f"rule={rule!r} must be a lightning_mpi Rule instance (e.g. SyncRule())")
        if collective_timeout is not None and not collective_timeout > 0:
            raise ValueError(
                f"collective_timeout={collective_timeout!r} is out of range: it must be > 0 seconds, or None to wait forever"
            )
        environment = MPIClusterEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=None,
            cluster_environment=environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.rule: Rule = rule if rule is not None else SyncRule()
        self.log_stats = log_stats
        self.abort_on_exception = abort_on_exception
        self.lr_scaling = lr_scaling
        self.warmup_steps = warmup_steps
        self.transport = Transport(environment.comm, timeout=collective_timeout)
        self._bound: Optional[BoundRule] = None
        self._pending_rule_state: Optional[dict[str, Any]] = None
        self._steps_seen = 0  # optimizer steps without a trainer to count them
        self._aid_stats: dict[str, float] = {}
        self.set_world_ranks()
        if warmup_steps and lr_scaling is None:
            rank_zero_warn(
                f"lightning_mpi: warmup_steps={warmup_steps} has no effect with lr_scaling=None (there is no factor "
                "to warm up to); set lr_scaling='linear' or 'sqrt'. ModelAveragingStrategy's synchronous warm-up is "
                "sync_warmup_steps.",
                category=UserWarning,
            )

    @property
    def collective_timeout(self) -> Optional[float]:
        """Seconds a collective may wait for the other ranks (``None``: forever); see the class docstring."""
        return self.transport.timeout

    @collective_timeout.setter
    def collective_timeout(self, value: Optional[float]) -> None:
        self.transport.timeout = value

    # -- where this rank lives -------------------------------------------------------------------
    @property
    def cluster_environment_mpi(self) -> MPIClusterEnvironment:
        assert isinstance(self.cluster_environment, MPIClusterEnvironment)
        return self.cluster_environment

    @property
    def num_nodes(self) -> int:
        return self.cluster_environment_mpi.num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        # The Trainer assigns its num_nodes flag; MPI knows better, so the flag is ignored.
        pass

    def set_world_ranks(self) -> None:
        # Lightning decides "rank zero only" output (progress bar, model summary, warnings) from these.
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if not devices:
            return torch.device("cpu")
        return devices[self.local_rank % len(devices)]

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- setup -------------------------------------------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.check_same_model()
        self.broadcast_module_state()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            from lightning_fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)
            self._bind_rule()
        self._connect_metrics()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def check_same_model(self) -> None:
        """Every rank must build the same model: compare parameter names, shapes and dtypes.

        A mismatch would make the exchange mix unrelated tensors (or hang on unequal buffer
        sizes), so it is an error on every rank, naming the first difference.
        """
        if self.world_size == 1:
            return
        assert self.model is not None
        signature = [(name, tuple(t.shape), str(t.dtype)) for name, t in self.model.state_dict(keep_vars=True).items()]
        digest = hashlib.sha256(repr(signature).encode()).hexdigest()
        digests = self.transport.comm.allgather(digest)
        if len(set(digests)) == 1:
            return
        signatures = self.transport.comm.allgather(signature)
        for rank, theirs in enumerate(signatures):
            if theirs == signatures[0]:
                continue
            for index in range(max(len(theirs), len(signatures[0]))):
                mine = signatures[0][index] if index < len(signatures[0]) else None
                other = theirs[index] if index < len(theirs) else None
                if mine != other:
                    raise ValueError(
                        f"lightning_mpi: ranks built different models. First difference at tensor #{index}: "
                        f"rank 0 has {mine}, rank {rank} has {other}. Build the model the same way on every "
                        "rank (same code, same hyperparameters); random initial values are fine, rank 0's are broadcast."
                    )

    def broadcast_module_state(self) -> None:
        """Make every rank start from rank 0's parameters and buffers (one Bcast per tensor group)."""
        if self.world_size == 1:
            return
        from lightning_mpi.comm.buffers import make_buckets

        assert self.model is not None
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers()) if t.is_floating_point()]
        for bucket in make_buckets(tensors, 1, bucket_bytes=None, reverse=False):
            bucket.pack()
            self.transport.broadcast_(bucket.flat, root=0)
            bucket.unpack()
        for t in (*self.model.parameters(), *self.model.buffers()):
            if not t.is_floating_point() and t.numel():
                with torch.no_grad():
                    self.transport.broadcast_(t.data if t.is_contiguous() else t.data.contiguous(), root=0)

    def _bind_rule(self) -> None:
        assert self.model is not None
        if self._bound is not None:
            self._bound.close()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._bound = self._rule_to_bind().bind(self.transport, params)
        if self._pending_rule_state is not None:
            self._bound.load_state_dict(self._pending_rule_state)
            self._pending_rule_state = None

    def _rule_to_bind(self) -> Rule:
        """The rule whose running part trains; ``self.rule`` (the user's hyperparameters) by default."""
        return self.rule

    def _connect_metrics(self) -> None:
        """Point every torchmetrics Metric in the module at MPI, so ``compute()`` syncs over it."""
        try:
            from torchmetrics import Metric
        except ImportError:  # torchmetrics is a dependency, but keep the strategy usable without it
            return
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, Metric):
                module.dist_sync_fn = self._gather_for_metrics
                module.distributed_available_fn = lambda: self.world_size > 1

    def _gather_for_metrics(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        """torchmetrics' ``dist_sync_fn``: every rank's tensor, shapes may differ between ranks."""
        gathered = self.transport.comm.allgather(tensor.detach().cpu())
        return [t.to(tensor.device) for t in gathered]

    # -- training ----------------------------------------------------------------------------------
    @property
    def bound_rule(self) -> Optional[BoundRule]:
        """The running rule during ``fit`` (None before setup)."""
        return self._bound

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning wraps backward in this while it accumulates gradients: the gradient hooks
        must not start exchanges then, only on the backward of the step that updates."""
        bound = self._bound
        if bound is None or not hasattr(bound, "sync_enabled"):
            yield
            return
        previous, bound.sync_enabled = bound.sync_enabled, False
        try:
            yield
        finally:
            bound.sync_enabled = previous

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._bound is not None:
            self._bound.on_train_start()
        self._announce_convergence_aids()

    # -- convergence aids (opt-in: nothing happens with their defaults) -----------------------------
    def _announce_convergence_aids(self) -> None:
        """Rank 0 says, once per fit, what the aids do; they never act silently."""
        if self.lr_scaling is not None:
            rank_zero_info(f"lightning_mpi: {describe_lr_scaling(self.lr_scaling, self.world_size, self.warmup_steps)}")

    def _implicit_momentum(self) -> Optional[float]:
        """Momentum to take off the optimizer's explicit momentum in each update, or None for no
        correction; the asynchronous strategies' ``momentum_correction`` sets it."""
        return None

    def _optimizer_step_count(self) -> int:
        trainer = getattr(self._lightning_module, "_trainer", None) if self._lightning_module is not None else None
        return int(trainer.global_step) if trainer is not None else self._steps_seen

    def _step_overrides(self, optimizer: Optimizer) -> Optional[StepOverrides]:
        """What to change in the param groups for this update, or None when nothing is opted in."""
        implicit = self._implicit_momentum()
        if self.lr_scaling is None and implicit is None:
            return None
        factor = lr_factor(self.lr_scaling, self.world_size, self._optimizer_step_count(), self.warmup_steps)
        return StepOverrides(optimizer, lr_factor=factor, implicit=implicit or 0.0, correct_momentum=implicit is not None)

    def _record_aid_stats(self, overrides: StepOverrides) -> None:
        if self.lr_scaling is not None:
            self._aid_stats["mpi/lr_scale"] = overrides.lr_factor
        if overrides.correct_momentum and overrides.momentum_used is not None:
            self._aid_stats["mpi/momentum_explicit"] = overrides.momentum_used[1]
            self._aid_stats["mpi/momentum_implicit"] = overrides.implicit

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        # The aids wrap the whole ``optimizer.step`` (LBFGS reads its lr before it calls the
        # closure) and are lifted while the closure runs (SGD/Adam call it first, then read the lr),
        # so only the update sees them; ``with`` puts the user's values back on every exit: a
        # finished step, a skipped one (``_SkipStep``) or an exception.
        overrides = self._step_overrides(optimizer)
        try:
            with overrides if overrides is not None else nullcontext():
                output = self._exchange_and_step(optimizer, closure, overrides, model, **kwargs)
        finally:
            self._steps_seen += 1
        if overrides is not None:
            self._record_aid_stats(overrides)
        self._log_rule_stats(self._bound)
        return output

    def _exchange_and_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        overrides: Optional[StepOverrides],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Backward (the closure), the rule's exchange, the update, the rule's ``after_step``."""
        lift = overrides.wrap_closure if overrides is not None else (lambda f: f)
        bound = self._bound
        if bound is None:
            return super().optimizer_step(optimizer, lift(closure), model, **kwargs)
        # A GradScaler (16-mixed) already skips steps with inf gradients and lowers its scale; it
        # must see them, so with a scaler the step is not abandoned here.
        scaler_handles_inf = getattr(self.precision_plugin, "scaler", None) is not None

        def closure_then_exchange() -> Any:
            result = closure()
            if not bound.before_step(optimizer) and not scaler_handles_inf:
                raise _SkipStep
            return result

        try:
            # backward and the exchange see the user's values; the update sees the aids
            output = super().optimizer_step(optimizer, lift(closure_then_exchange), model, **kwargs)
        except _SkipStep:
            output = None
        else:
            bound.after_step(optimizer)
        return output

    def _log_rule_stats(self, bound: Optional[BoundRule]) -> None:
        """Rank 0 logs the rule's numbers (world size > 1) and the convergence aids' values."""
        if not self.log_stats:
            return
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.loggers:
            return
        if (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        metrics: dict[str, float] = {}
        if bound is not None and self.world_size > 1:
            metrics.update({f"mpi/{self.rule.name}/{k}": v for k, v in bound.stats().items()})
        metrics.update(self._aid_stats)
        if metrics and self.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self) -> None:
        if self._bound is not None:
            self._bound.on_train_end()
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        """One rank failed: bring the whole job down now, with this rank's traceback visible.

        The other ranks are (or soon will be) waiting in a collective that this rank will never
        join, so re-raising alone would hang the job until its allocation runs out. Callbacks'
        ``on_exception`` hooks (cleanup) have already run; loggers are finalised here.
        """
        super().on_exception(exception)
        if self.world_size == 1 or not self.abort_on_exception or isinstance(exception, KeyboardInterrupt):
            return
        trainer = getattr(self.lightning_module, "_trainer", None) if self._lightning_module is not None else None
        for logger in getattr(trainer, "loggers", []) or []:
            try:
                logger.finalize("failed")
            except Exception:  # the job is going down; a logger error must not hide the real one
                pass
        text = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
        sys.stderr.write(
            f"lightning_mpi: rank {self.global_rank} of {self.world_size} failed; aborting every rank.\n{text}"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        # mpiexec forwards each rank's output through its proxies asynchronously; Abort makes it
        # kill every proxy at once, which can drop lines still in flight (a CI run lost this very
        # traceback). A short pause on a path that is ending the job anyway lets them through.
        time.sleep(ABORT_FLUSH_SECONDS)
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        os._exit(1)  # not reached: Abort does not return

    def teardown(self) -> None:
        if self._bound is not None:
            self._bound.close()
        super().teardown()

    # -- collectives for Lightning ------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce a tensor over all ranks (``mean`` by default); non-tensors pass through unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = _reduce_op_name(reduce_op)
        if self.world_size == 1:
            return tensor
        original_dtype = tensor.dtype
        if tensor.is_floating_point() or op == "mean":
            work = tensor.detach().to(torch.float64, copy=True)
        elif tensor.dtype == torch.bool:
            work = tensor.detach().to(torch.int64)
        else:
            work = tensor.detach().clone()
        work = work.contiguous()
        self.transport.allreduce_(work, "sum" if op == "mean" else op)
        if op == "mean":
            work /= self.world_size
            return work.to(original_dtype if original_dtype.is_floating_point else torch.float32)
        return work.to(original_dtype)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Stack every rank's tensor (same shape on every rank) into ``[world_size, *shape]``.

        ``sync_grads=True`` is not supported: gradients do not flow back through MPI.
        """
        if sync_grads:
            raise ValueError("sync_grads=True is not supported by MPIStrategy.all_gather: gradients do not flow through MPI")
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        src = tensor.detach().contiguous()
        out = torch.empty((self.world_size, *src.shape), dtype=src.dtype, device=src.device)
        self.transport.allgather(src.reshape(1, -1), out.view(self.world_size, -1))
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank ``src`` to every rank."""
        if self.world_size == 1:
            return obj
        return self.transport.broadcast_object(obj, root=src)

    def barrier(self, name: Optional[str] = None) -> None:
        if self.world_size > 1:
            self.transport.barrier()

    # -- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Rank 0 writes; the rule's state (center, clocks, ...) is added to the checkpoint first.

        Called on every rank, so a rule with sharded state may gather it here.
        """
        if self._bound is not None:
            checkpoint["lightning_mpi"] = {"rule": type(self.rule).__name__, "state": self._bound.state_dict(), "world_size": self.world_size}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Every rank reads the checkpoint; the rule's state is restored when the rule is bound."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False if weights_only is None else weights_only)
        saved = checkpoint.get("lightning_mpi")
        if saved is not None:
            if saved.get("world_size") != self.world_size:
                warnings.warn(
                    f"lightning_mpi: checkpoint was written at world size {saved.get('world_size')}, "
                    f"resuming at {self.world_size}; sharded rule state is re-sharded.",
                    RuntimeWarning,
                )
            if self._bound is not None:
                self._bound.load_state_dict(saved["state"])
            else:
                self._pending_rule_state = saved["state"]
        return checkpoint


class SyncStrategy(MPIStrategy):
    """Synchronous data parallelism: every step, average gradients (or weights) over all ranks.

    Registered as ``mpi_allreduce``, ``mpi_asa``, ``mpi_asa16`` and ``mpi_asa_bf16``.

    Args:
        exchange: ``"allreduce"``: one ``MPI_Allreduce`` per bucket. ``"asa"``: Theano-MPI's
            Alltoall → local fp32 sum → Allgather.
        wire: ``"fp32"``, ``"fp16"`` or ``"bf16"`` on the wire (16-bit needs ``exchange="asa"``):
            half the bytes, fp32 accumulation, one rounding of the sum.
        average: ``"gradients"`` (W ranks × batch B = one process × batch W·B), ``"weights"``
            (Theano-MPI's AWAGD: local step, then average weights) or ``"weights+momentum"``
            (also average the optimizer's momentum/moment buffers).
        bucket_mb: exchange bucket size in MiB (> 0).
        first_bucket_mb: size of the first bucket in MiB (> 0): small, so that the exchange
            starts after the last layer or two of backward.
        overlap: start each bucket's exchange from the gradient hooks as soon as its gradients
            are ready, so it runs behind the rest of backward.
        segment_mb: each bucket is exchanged as a pipeline of segments of this size (MiB): the
            cast and sum of one segment overlap the transfer of the next.
        topology_aware: reduce within each node over shared memory, exchange only among node
            leaders across the network, then broadcast within the node.
        **kwargs: the options every strategy takes (see :class:`MPIStrategy`): ``log_stats``
            (exchange time, bytes and skipped steps under ``mpi/sync/``), ``abort_on_exception``,
            ``collective_timeout``, ``lr_scaling``, ``warmup_steps``.
    """

    def __init__(
        self,
        exchange: Literal["allreduce", "asa"] = "allreduce",
        wire: Literal["fp32", "fp16", "bf16"] = "fp32",
        average: Literal["gradients", "weights", "weights+momentum"] = "gradients",
        bucket_mb: float = 25.0,
        overlap: bool = True,
        segment_mb: float = 4.0,
        topology_aware: bool = False,
        first_bucket_mb: float = 1.0,
        **kwargs: Any,
    ) -> None:
        rule = SyncRule(
            exchange=exchange,
            wire=wire,
            average=average,
            bucket_mb=bucket_mb,
            overlap=overlap,
            segment_mb=segment_mb,
            topology_aware=topology_aware,
            first_bucket_mb=first_bucket_mb,
        )
        super().__init__(rule=rule, **kwargs)
