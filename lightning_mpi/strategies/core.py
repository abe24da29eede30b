"""What every frontend's strategy does over MPI, with no Lightning in it.

:class:`MPIStrategyCore` is mixed into the Trainer strategies (:mod:`.trainer`) and the Fabric
strategies (:mod:`.fabric`) of every Lightning package. It owns the rule's lifecycle and the
collectives; the frontend mixins only decide *when* Lightning calls them:

- :meth:`prepare_module`: every rank checks it built the same model, then takes rank 0's
  parameters and buffers.
- :meth:`bind_rule`: the rule's running part over the trainable parameters (and any state
  restored from a checkpoint before it was bound).
- :meth:`reduce` / :meth:`all_gather` / :meth:`broadcast` / :meth:`barrier`: Lightning's
  collectives over MPI, so that no ``torch.distributed`` process group is ever created.
- :meth:`rule_checkpoint` / :meth:`restore_rule`: the rule's state in a checkpoint.
- :meth:`fail_run` / :meth:`propagate_errors`: one rank's exception becomes
  :class:`~lightning_mpi.comm.errors.RankFailedError` on the others (see :mod:`.failures`).
"""
from __future__ import annotations

import hashlib
import warnings
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.sync import SyncRule
from lightning_mpi.strategies.failures import FailurePropagation

#: Key of the rule's state in a checkpoint dictionary.
CHECKPOINT_KEY = "lightning_mpi"

def reduce_op_name(reduce_op: Any) -> str:
    """Map Lightning/torch reduce ops ("mean", "avg", "sum", ReduceOp.SUM, ...) to a short name."""
    name = str(getattr(reduce_op, "name", reduce_op) if reduce_op is not None else "mean").lower()
    name = name.rsplit(".", 1)[-1]
    aliases = {"avg": "mean", "mean": "mean", "sum": "sum", "max": "max", "min": "min", "product": "prod", "prod": "prod"}
    if name not in aliases:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported: use one of 'mean', 'sum', 'max', 'min', 'prod'")
    return aliases[name]


def check_rule(rule: Any) -> None:
    """Raise ``ValueError`` unless ``rule`` is ``None`` or a :class:`Rule`."""
    if rule is not None and not isinstance(rule, Rule):
        raise ValueError(f"rule={rule!r} must be a lightning_mpi Rule instance (e.g. SyncRule())")


def check_collective_timeout(value: Optional[float]) -> None:
    """Raise ``ValueError`` unless ``value`` is ``None`` or a positive number of seconds."""
    if value is not None and not value > 0:
        raise ValueError(
            f"collective_timeout={value!r} is out of range: it must be > 0 seconds, or None to wait forever"
        )


def check_arguments(rule: Any, collective_timeout: Optional[float], lr_scaling: Any, warmup_steps: int) -> None:
    """Raise ``ValueError`` for a bad option every strategy takes, naming it, its value and the fix."""
    from lightning_mpi.lr_scaling import check_lr_scaling, check_warmup_steps

    check_rule(rule)
    check_collective_timeout(collective_timeout)
    check_lr_scaling(lr_scaling)
    check_warmup_steps(warmup_steps)


def module_signature(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every entry of the module's state dict, in order."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in module.state_dict(keep_vars=True).items()]


def first_difference(signatures: list[list[Any]]) -> Optional[str]:
    """A message naming the first tensor where some rank's signature differs from rank 0's, or None."""
    for rank, theirs in enumerate(signatures):
        if theirs == signatures[0]:
            continue
        for index in range(max(len(theirs), len(signatures[0]))):
            mine = signatures[0][index] if index < len(signatures[0]) else None
            other = theirs[index] if index < len(theirs) else None
            if mine != other:
                return (
                    f"lightning_mpi: ranks built different models. First difference at tensor #{index}: "
                    f"rank 0 has {mine}, rank {rank} has {other}. Build the model the same way on every "
                    "rank (same code, same hyperparameters); random initial values are fine, rank 0's are broadcast."
                )
    return None


class MPIStrategyCore(FailurePropagation):
    """Rule lifecycle and collectives over MPI, shared by every frontend (see the module docstring).

    The frontend mixin calls :meth:`_init_core` from its ``__init__``; ``world_size`` and
    ``global_rank`` come from the frontend's cluster environment.
    """

    world_size: int
    global_rank: int
    _environment_class: type  # the MPI cluster environment on the frontend's Fabric package
    _checkpoint_io_class: type  # the atomic checkpoint IO on it

    def _placement(self, rule: Optional[Rule], collective_timeout: Optional[float], lr_scaling: Any,
                   warmup_steps: int, checkpoint_io: Optional[Any]) -> dict[str, Any]:
        """The ``ParallelStrategy`` arguments every frontend passes: MPI's cluster environment and
        atomic checkpoint files (unless the user gave a checkpoint IO), no device list (Lightning
        fills it in). Every common option is checked first, before the environment's first
        collective (it splits ``COMM_WORLD``)."""
        check_arguments(rule, collective_timeout, lr_scaling, warmup_steps)
        return {
            "parallel_devices": None,
            "cluster_environment": self._environment_class(),
            "checkpoint_io": checkpoint_io if checkpoint_io is not None else self._checkpoint_io_class(),
        }

    def _init_core(self, rule: Optional[Rule], comm: Any, collective_timeout: Optional[float]) -> None:
        check_rule(rule)
        check_collective_timeout(collective_timeout)
        self.rule: Rule = rule if rule is not None else SyncRule()
        self._bound: Optional[BoundRule] = None
        self._pending_rule_state: Optional[dict[str, Any]] = None
        self._init_failures(comm, collective_timeout)

    @property
    def collective_timeout(self) -> Optional[float]:
        """Seconds a collective may wait for the other ranks (``None``: forever)."""
        return self._collective_timeout

    @collective_timeout.setter
    def collective_timeout(self, value: Optional[float]) -> None:
        check_collective_timeout(value)
        self._collective_timeout = value
        if self._transport is not None:
            self._transport.timeout = value

    @property
    def bound_rule(self) -> Optional[BoundRule]:
        """The running rule while training (None before it is bound)."""
        return self._bound

    # -- where this rank lives ---------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """Rank ``r`` uses device ``local_rank % devices_on_this_host`` (the CPU without devices)."""
        devices = self.parallel_devices  # type: ignore[attr-defined]  # the frontend's ParallelStrategy
        if not devices:
            return torch.device("cpu")
        return devices[self.local_rank % len(devices)]  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @contextmanager
    def exchanges_paused(self) -> Generator[None, None, None]:
        """While gradients accumulate without an update, the rule's gradient hooks start no exchange
        (``sync_enabled`` off); the backward of the step that updates exchanges."""
        bound = self._bound
        if bound is None:
            yield
            return
        previous, bound.sync_enabled = bound.sync_enabled, False
        try:
            yield
        finally:
            bound.sync_enabled = previous

    # -- the model --------------------------------------------------------------------------------
    def prepare_module(self, module: torch.nn.Module) -> None:
        """Check that every rank built the same model, then give every rank rank 0's weights."""
        self.check_same_model(module)
        self.broadcast_module_state(module)

    def check_same_model(self, module: torch.nn.Module) -> None:
        """Every rank must build the same model: compare parameter names, shapes and dtypes.

        A mismatch would make the exchange mix unrelated tensors (or hang on unequal buffer
        sizes), so it is an error on every rank, naming the first difference.
        """
        if self.world_size == 1:
            return
        signature = module_signature(module)
        digest = hashlib.sha256(repr(signature).encode()).hexdigest()
        if len(set(self.transport.allgather_object(digest))) == 1:
            return
        message = first_difference(self.transport.allgather_object(signature))
        if message is not None:
            raise ValueError(message)

    def broadcast_module_state(self, module: torch.nn.Module) -> None:
        """Make every rank start from rank 0's parameters and buffers (one Bcast per tensor group)."""
        if self.world_size == 1:
            return
        from lightning_mpi.comm.buffers import make_buckets

        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
        for bucket in make_buckets(tensors, 1, bucket_bytes=None, reverse=False):
            bucket.pack()
            self.transport.broadcast_(bucket.flat, root=0)
            bucket.unpack()
        for t in (*module.parameters(), *module.buffers()):
            if not t.is_floating_point() and t.numel():
                with torch.no_grad():
                    self.transport.broadcast_(t.data if t.is_contiguous() else t.data.contiguous(), root=0)

    # -- the rule ---------------------------------------------------------------------------------
    def bind_rule(self, module: torch.nn.Module) -> BoundRule:
        """Bind the rule to the module's trainable parameters (closing a previous binding first)."""
        self.close_rule()
        params = [p for p in module.parameters() if p.requires_grad]
        self._bound = self._rule_to_bind().bind(self.transport, params)
        if self._pending_rule_state is not None:
            self._bound.load_state_dict(self._pending_rule_state)
            self._pending_rule_state = None
        return self._bound

    def _rule_to_bind(self) -> Rule:
        """The rule whose running part trains; ``self.rule`` (the user's hyperparameters) by default."""
        return self.rule

    def close_rule(self) -> None:
        """Release the bound rule's threads, windows and requests (safe to call twice, or when none
        is bound). The closed rule stays readable as :attr:`bound_rule` (its ``stats()``) until the
        next :meth:`bind_rule`."""
        if self._bound is not None:
            self._bound.close()

    def rule_checkpoint(self) -> Optional[dict[str, Any]]:
        """The rule's state for a checkpoint, or None when no rule is bound. Called on every rank:
        a rule with sharded state gathers it here."""
        if self._bound is None:
            return None
        return {"rule": type(self.rule).__name__, "state": self._bound.state_dict(), "world_size": self.world_size}

    def restore_rule(self, saved: Optional[dict[str, Any]]) -> None:
        """Load what :meth:`rule_checkpoint` saved: now if the rule is bound, else when it is bound."""
        if saved is None:
            return
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

    # -- collectives -------------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Reduce a tensor over all ranks (``mean`` by default); non-tensors pass through unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        op = reduce_op_name(reduce_op)
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

    # -- torchmetrics ------------------------------------------------------------------------------
    def connect_metrics(self, module: torch.nn.Module) -> None:
        """Point every torchmetrics Metric in the module at MPI, so ``compute()`` syncs over it."""
        try:
            from torchmetrics import Metric
        except ImportError:  # torchmetrics is a dependency, but keep the strategy usable without it
            return
        for child in module.modules():
            if isinstance(child, Metric):
                child.dist_sync_fn = self._gather_for_metrics
                child.distributed_available_fn = lambda: self.world_size > 1

    def _gather_for_metrics(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        """torchmetrics' ``dist_sync_fn``: every rank's tensor, shapes may differ between ranks."""
        gathered = self.transport.allgather_object(tensor.detach().cpu())
        return [t.to(tensor.device) for t in gathered]
