"""ZeRO stages 1 and 2 on ASA: the optimizer state and the reduced gradients sharded over the ranks.

ASA's Alltoall and local fp32 sum are a reduce-scatter: afterwards rank ``r`` holds the averaged
gradient of chunk ``r`` of every bucket (:mod:`lightning_mpi.rules.zero.layout`). Here each rank steps
only that chunk, with optimizer state only for it, and the Allgather that ASA would spend on the
averaged gradients carries the updated weights instead. The bytes on the wire are ASA's; the
optimizer state (stage 1) and the gradients kept after backward (stage 2: a bucket's gradients are
freed as soon as they are packed for the reduce-scatter) shrink by the world size ``W``. Memory per
rank is about the weights plus (gradients + optimizer state) / W, plus a few buckets in flight.

The strategy drives it like any rule (:mod:`lightning_mpi.rules.base`), plus three calls:

1. ``bind`` → ``shard_optimizer(optimizer)`` once, after the model is on its device with its
   final weights and the optimizer exists, before any optimizer state is loaded.
2. per step: backward → ``before_step(optimizer)`` (reduce-scatter; ``False``: skip) →
   ``clip_grad_norm_(max_norm)`` instead of torch's (the norm is global over the shards) →
   ``optimizer.step()`` → ``after_step(optimizer)`` (Allgather of the weights).
3. checkpoints: ``optimizer_state()`` (this rank's shard) / ``load_optimizer_state(saved)`` (a shard,
   all shards of a save at any world size, or torch's full format).

``wire="bf16"`` (or ``"fp16"``) sends gradients as 16-bit values with fp32 sums, as ASA does, and
sends the change of the weights the same way, with fp32 master weights on the owner (see
:mod:`lightning_mpi.rules.zero.bucket`). The error-feedback codecs (int8, 1-bit, top-k) are not
offered: their residual is a full-size per-rank copy of the gradient, the very memory stage 2
frees, and without it they are biased.

A strategy reaches these through the rule contract's :class:`~lightning_mpi.rules.base.OptimizerShards`
(:attr:`BoundZeroRule.optimizer_shards`): :meth:`BoundZeroRule.take_optimizer` shards the user's
optimizer, after a heal rebuilding it from the survivors' shards.

Healing. Under the strategy's ``heal`` (``shard_optimizer(optimizer, mirror=True)``, which
:meth:`~BoundZeroRule.take_optimizer` passes when ``healing`` is set) each rank also keeps an exact
copy of one other rank's shard, its buddy's ((r + 1) % W), so that a heal loses no optimizer state
(:mod:`lightning_mpi.rules.zero.mirror`); the reduce-scatter then starts in ``before_step`` rather
than during backward. A survivor keeps (:meth:`~BoundZeroRule.heal_state`) its counters, its own
shard and its buddy's mirror, each with its weights, and the optimizer steps taken. The new
binding puts the weights back whole and rebuilds the whole optimizer state from them, resharded
(:meth:`~BoundZeroRule.take_optimizer`); a lost shard whose mirror was lost too, or survivors at
different optimizer steps: ``RankFailedError``. ``before_step`` is redone as the synchronous rules
redo it (this rank's gradients put back); ``after_step`` (the Allgather) and a lossy wire's final
exact one (``on_train_end``) are redone on the rebuilt weights. A rank let in (``heal="replace"``)
takes no shard of its own: the survivors' shards, the whole state, are resharded over the grown run.

The global gradient norm (:class:`ShardGradNorm`). After the reduce-scatter each rank holds the
averaged gradients of its own chunks only (each :class:`~lightning_mpi.rules.zero.bucket.ShardBucket`'s
``grad``), so a norm over the whole model is a sum (or a max) over this rank's buckets and then one
8-byte Allreduce over the ranks (:meth:`ShardGradNorm.global_sum`):

- :meth:`ShardGradNorm.agree`, once per step after the reduce-scatter, on every rank: the global
  sum of squares (non-finite: the step is skipped everywhere), remembered with the gradients'
  versions;
- :meth:`ShardGradNorm.clip_`, between ``before_step`` and ``optimizer.step()`` on every rank:
  torch's ``clip_grad_norm_`` over the whole model. The 2-norm reuses :meth:`agree`'s sum while the
  gradients are unchanged (no collective); any other norm, or changed gradients, is a collective.
  Norms are taken per bucket in the gradients' dtype and summed in float64 (no float64 copy of
  the shard).

Beside this module: :mod:`~lightning_mpi.rules.zero.layout` (the buckets and chunks),
:mod:`~lightning_mpi.rules.zero.bucket` (one bucket's reduce-scatter and Allgather),
:mod:`~lightning_mpi.rules.zero.schedule` (when the buckets go, staging, MPI progress),
:mod:`~lightning_mpi.rules.zero.optimizer` (the optimizer over this rank's pieces),
:mod:`~lightning_mpi.rules.zero.state` (the shard format of checkpoints) and
:mod:`~lightning_mpi.rules.zero.mirror` (the buddy copies under ``heal``).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, option, options_class, with_default
from lightning_mpi.rules.base import BoundRule, Execute, Operation, OptimizerShards, Rule, gradient_exchange
from lightning_mpi.rules.buckets import SegmentedBuckets
from lightning_mpi.rules.zero.bucket import ShardBucket
from lightning_mpi.rules.zero.layout import ParamSpec, plan_buckets
from lightning_mpi.rules.zero.mirror import MirrorShard, rebuild_shards, write_weights
from lightning_mpi.rules.zero.optimizer import ShardedOptimizer, check_elementwise
from lightning_mpi.rules.zero.schedule import BucketSchedule


@options_class
class ZeroRule(Rule):
    """Average gradients every step by ASA, with the optimizer sharded over the ranks (ZeRO stages 1
    and 2; see the module docstring). ``SyncStrategy(shard_optimizer=True)`` trains with it;
    registered as ``mpi_zero`` and ``mpi_zero_bf16``.
    """

    name = "zero"

    wire: Literal["fp32", "fp16", "bf16"] = option(
        default="fp32",
        doc="the format on the wire: 16-bit formats send gradients and weight changes in 16 bits, with fp32 "
        "sums and fp32 master weights on each shard's owner.",
    )
    bucket_mb: float = with_default(SegmentedBuckets, "bucket_mb", default=4.0)
    overlap: bool = with_default(SegmentedBuckets, "overlap", default=True)
    inflight_buckets: int = option(
        default=4,
        doc="buckets exchanged at once (≥ 1); each holds about 2 x `bucket_mb` of staging memory, and a bucket "
        "waits for a free one.",
        check=integer(1),
    )
    progress_thread: bool = with_default(SegmentedBuckets, "progress_thread", default=True)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundZeroRule:
        return BoundZeroRule(self, transport, params)


class BoundZeroRule(BoundRule):
    def __init__(self, rule: ZeroRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        self.rule = rule
        # one rank has no wire: a lossy codec would only round its own weights
        self.codec = get_codec(rule.wire if transport.size > 1 else "fp32")
        specs = [ParamSpec.of(p) for p in self.params]
        plans = plan_buckets(specs, transport.size, max(1, int(rule.bucket_mb * 2**20)))
        # One communicator for every bucket's exchanges: non-blocking collectives must start in the
        # same order on every rank, and buckets start strictly in index order (.schedule), so one
        # suffices where SyncRule, whose hooks start buckets as they become ready, needs one per
        # bucket (MPICH has a few thousand communicator ids; a 10 GB model has 2,500 buckets).
        self.team = transport.dup() if transport.size > 1 else transport
        last_bucket = {seg.param: plan.index for plan in plans for seg in plan.segments}  # buckets go in order
        last_segment = {(bucket, param) for param, bucket in last_bucket.items()}
        self._taken: dict[int, Tensor] = {}
        self.buckets = [
            ShardBucket(plan, self.params, transport.rank, self.team, self.codec, last_segment, self._taken)
            for plan in plans
        ]
        #: the buckets each parameter has elements in (a cut parameter has several)
        self._buckets_of: dict[int, list[int]] = {}
        for plan in plans:
            for member in plan.members:
                self._buckets_of.setdefault(member, []).append(plan.index)
        self.schedule = BucketSchedule(
            transport,
            self.buckets,
            self.codec,
            rule.inflight_buckets,
            progress_thread=rule.overlap and rule.progress_thread,
            # mirrored (heal): the exchange starts in before_step, from gradients that a redo after a
            # heal can put back (stage 2 would free them during backward)
            hooks_launch=lambda: self.sync_enabled and not self.mirrored,
        )
        self.norm = ShardGradNorm(transport, self.buckets)
        self.sharded: ShardedOptimizer | None = None
        #: the buddy copy of rank (r + 1) % W's shard, under ``heal`` (:mod:`~lightning_mpi.rules.zero.mirror`)
        self.mirror: MirrorShard | None = None
        self.mirrored = False
        #: optimizer steps taken since the run started (carried through heals): the survivors compare them
        self.optimizer_steps = 0
        #: what the survivors kept of the binding before a heal (``load_state_dict``), until resharded
        self.healed_from: dict[str, Any] | None = None
        #: the weights are whole (the last step's Allgather completed): a heal need not write them
        self.whole = True
        self._step_hook: Any = None
        self.skipped_steps = 0
        self.exchange_count = 0
        self._seconds = 0.0
        self._last: dict[str, float] = {}
        self._closed = False
        if rule.overlap:
            self.schedule.hook_params(self.params, self._buckets_of)

    @property
    def hook_launches(self) -> int:
        """Buckets whose reduce-scatter started from the gradient hooks (during backward)."""
        return self.schedule.hook_launches

    # -- the optimizer ---------------------------------------------------------------------------
    def shard_optimizer(self, optimizer: Optimizer, mirror: bool = False) -> Optimizer:
        """Rebuild ``optimizer`` in place over this rank's pieces and return it (the same object).

        Call once after ``bind``, with the model's final weights in place (they seed the fp32
        master weights where a bucket keeps them) and before loading optimizer state. ``mirror``
        (the strategy's ``heal`` is set): also keep the buddy copy of rank (r + 1) % W's shard
        (:mod:`~lightning_mpi.rules.zero.mirror`), and start the reduce-scatter in ``before_step``
        rather than from the gradient hooks (a redo after a heal puts the gradients back).

        Raises:
            ValueError: the optimizer is not element-wise (LBFGS, ...), or does not hold exactly the
                trainable parameters (see :class:`~lightning_mpi.rules.zero.optimizer.ShardedOptimizer`).
        """
        check_elementwise(optimizer)
        if self.sharded is not None and self.sharded.optimizer is optimizer:
            return optimizer
        # the state it holds before sharding (Adagrad's accumulator; a resumed optimizer): the mirror's too
        whole = [p for group in optimizer.param_groups for p in group["params"]]
        before = {i: dict(optimizer.state[p]) for i, p in enumerate(whole) if optimizer.state.get(p)}
        if self.sharded is not None:
            raise ValueError("this ZeroRule already shards another optimizer; ZeRO supports one optimizer per model")
        pieces = [p for b in self.buckets for p in b.pieces]
        tensors = [t for b in self.buckets for t in b.piece_tensors]
        self.sharded = ShardedOptimizer(
            optimizer, self.params, pieces, tensors, self.transport.size, self.transport.rank
        )
        grads = {id(t): g for b in self.buckets for t, g in zip(b.piece_tensors, b.piece_grads, strict=True)}
        self._piece_grads = [(t, grads[id(t)]) for t in self.sharded.tensors]
        self.mirrored = mirror
        if mirror and self.transport.size > 1:
            masters = {id(t) for b in self.buckets if b.master is not None for t in b.piece_tensors}
            self.mirror = MirrorShard(
                self.sharded,
                self.buckets,
                self.params,
                [id(t) in masters for t in self.sharded.tensors],
                self.transport.rank,
                self.transport.size,
            )
            self.mirror.load({"state": before})
        if mirror:
            self._step_hook = optimizer.register_step_post_hook(self._owner_stepped)
        return optimizer

    @property
    def optimizer_shards(self) -> OptimizerShards:
        return self

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer this rule shards (once :meth:`take_optimizer` or :meth:`shard_optimizer` ran)."""
        return None if self.sharded is None else self.sharded.optimizer

    @property
    def same_weights(self) -> bool:
        """Every step's Allgather leaves the same weights on every rank."""
        return True

    def take_optimizer(self, optimizer: Optimizer, previous: BoundRule | None) -> bool:
        """The strategy's one call (:class:`~lightning_mpi.rules.base.OptimizerShards`): shard
        ``optimizer`` (:meth:`shard_optimizer`, with the buddy copy while ``healing``).

        After a heal (this binding holds what the survivors kept: its ``healed_from``), collectively
        over the survivors: the optimizer gets its whole parameters back from the binding before
        (``previous``), the weights are put back whole where a step's Allgather was interrupted,
        and the optimizer state is rebuilt from every survivor's own shard and mirror
        (:func:`~lightning_mpi.rules.zero.mirror.rebuild_shards`), then sharded for the new world
        size. When new ranks are let in (``heal="replace"``) the same collective runs over survivors
        and new ranks: a new rank's ``healed_from`` says it joined (it kept nothing, had no binding
        before, and holds rank 0's weights already); the survivors' shards, the whole state, are
        resharded over the grown run. Returns whether this rank is such a new rank (its shard is
        rebuilt already: the optimizer state handed over to it is not to be loaded).

        Raises:
            RankFailedError: after a heal, a lost shard has no mirror left, or the survivors are at
                different optimizer steps (:func:`~lightning_mpi.rules.zero.mirror.rebuild_shards`).
        """
        healed, self.healed_from = self.healed_from, None
        if healed is None:
            self.shard_optimizer(optimizer, mirror=self.healing)
            return False
        joined = bool(healed.get("joined"))  # a new rank let in (heal="replace"): it kept nothing
        before = previous if isinstance(previous, BoundZeroRule) and previous.sharded is not None else None
        assert joined or before is not None, "a heal rebinds a ZeRO rule whose optimizer was sharded"
        kept = [k for k in self.transport.allgather_object(healed) if not k.get("joined")]
        shards, steps = rebuild_shards(kept)
        if before is not None and before.sharded is not None:  # (checked above; for the type checker)
            before.sharded.unshard()
            if not all(k.get("whole", True) for k in kept):
                # a step's Allgather was interrupted: every survivor's weights whole again from the pieces
                write_weights(shards, before.sharded.originals)
        self.shard_optimizer(optimizer, mirror=self.healing)
        self.load_optimizer_state(shards)  # resharded for the new world size, master weights included
        self.optimizer_steps = steps
        return joined

    def _owner_stepped(self, *_: Any) -> None:
        """The optimizer stepped this rank's shard: the mirror steps its buddy's (both local)."""
        if self.mirror is not None:
            self.mirror.step()
        self.optimizer_steps += 1
        self.whole = False

    def _require(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer
        if self.sharded is None or self.sharded.optimizer is not inner:
            raise ValueError(
                f"optimizer={type(inner).__name__} was not sharded by this ZeroRule: call "
                "bound_rule.shard_optimizer(optimizer) once after bind, before training"
            )
        if any(b.storage_moved() for b in self.buckets if b.master is None):
            raise ValueError(
                "the model's parameters were replaced (moved to another device or dtype?) after shard_optimizer; "
                "put the model on its device and dtype first, then bind the rule and shard the optimizer"
            )

    # -- reduce-scatter (scheduled by :mod:`~lightning_mpi.rules.zero.schedule`) -------------------
    def before_step(self, optimizer: Optimizer) -> bool:
        """Reduce-scatter every bucket not yet launched, wait for all, hand the optimizer its
        gradient pieces, and agree on the global gradient norm (one 8-byte Allreduce): a step whose
        averaged gradients hold inf or NaN anywhere is skipped on every rank, and its gradients are
        set to NaN on every rank so that a GradScaler skips it everywhere too."""
        self._require(optimizer)
        begin = time.perf_counter()
        self.exchange_count += 1
        self.schedule.reduce_scatter_rest()
        self._taken.clear()
        for tensor, grad in self._piece_grads:
            tensor.grad = grad
        if self.mirror is not None:  # this rank's averaged chunks to the rank that mirrors it (1/W of the bytes)
            self.mirror.exchange(self.team, [b.grad for b in self.buckets])
        total = self.norm.agree()  # the global sum of squares (:class:`ShardGradNorm`)
        self._seconds += time.perf_counter() - begin
        finite = math.isfinite(total)
        if not finite:
            self.skipped_steps += 1
            for bucket in self.buckets:
                bucket.grad.fill_(float("nan"))
            warnings.warn(
                f"lightning_mpi: non-finite gradients after the reduce-scatter (wire={self.rule.wire}); skipping this "
                f"optimizer step on every rank ({self.skipped_steps} skipped so far).",
                RuntimeWarning,
                stacklevel=2,
            )
        return finite

    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        return execute(gradient_exchange(optimizer))

    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        # the Allgather of the stepped chunks: redone on the healed run, whose weights and optimizer
        # state were rebuilt from the survivors' shards and mirrors as of this step (a survivor that
        # missed its completion has them so too: nothing to take)
        execute(
            Operation(
                "the allgather",
                lambda bound: bound.after_step(optimizer),
                collective=lambda bound, _: bound.transport.size > 1,
            )
        )

    def healable_train_end(self, execute: Execute) -> None:
        # a lossy wire's last exact Allgather of the master weights: redone on the healed run (whose
        # masters were rebuilt from the survivors' shards and copies)
        execute(
            Operation(
                "the final allgather",
                lambda bound: bound.on_train_end(),
                collective=lambda bound, _: bound.codec.lossy and bound.transport.size > 1,
            )
        )

    def hand_over(self, kept: dict[str, Any], joining: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A rank let in takes no optimizer shard of its own: the survivors' shards, the whole state,
        are resharded over the grown run (:meth:`take_optimizer`)."""
        kept, handed = super().hand_over(kept, joining)
        if isinstance(handed.get("zero_heal"), dict):
            handed["zero_heal"] = {"joined": True}
        return kept, handed

    # -- clipping --------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, sharded: the norm is global.

        Call between ``before_step`` and ``optimizer.step()`` on every rank (a collective, unless
        ``norm_type`` is 2 and the gradients are unchanged since ``before_step``). Returns the total
        norm, as torch's does."""
        coefficient, total = self.norm.clip_(max_norm, norm_type, error_if_nonfinite)
        if self.mirror is not None:
            self.mirror.scale(coefficient)
        return total

    # -- allgather ---------------------------------------------------------------------------------
    def after_step(self, optimizer: Optimizer, exact: bool = False) -> None:
        """Allgather every bucket's stepped chunk into the parameters (a few buckets at once)."""
        begin = time.perf_counter()
        self.schedule.gather(exact)
        self.whole = True
        self._seconds += time.perf_counter() - begin
        self._last = {
            "exchange_seconds": self._seconds,
            "wire_bytes": float(self._wire_bytes()),
            "skipped_steps": float(self.skipped_steps),
        }
        self._seconds = 0.0

    def on_train_end(self) -> None:
        """With a lossy wire the members hold the master weights up to the wire's rounding of the
        last change: give them the master's exact values once (an fp32 Allgather)."""
        if self.codec.lossy and self.sharded is not None:
            self.after_step(self.sharded.optimizer, exact=True)

    # -- state -----------------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer shard (:mod:`lightning_mpi.rules.zero.state`), with the fp32 master
        weights of its pieces under ``_master`` where a bucket keeps them (exact resume)."""
        if self.sharded is None:
            raise ValueError("no optimizer is sharded yet: call shard_optimizer(optimizer) first")
        shard = self.sharded.shard_state()
        masters = {id(t) for b in self.buckets if b.master is not None for t in b.piece_tensors}
        for tensor, state in zip(self.sharded.tensors, shard["state"], strict=True):
            if id(tensor) in masters:
                state["_master"] = tensor.detach()
        return shard

    def load_optimizer_state(self, saved: Any) -> None:
        """Load torch's full format (a plain checkpoint), one shard (same layout), or the list of all
        shards of a sharded save (any world size). Load the module's weights first: master weights
        that the save does not hold are taken from them."""
        if self.sharded is None:
            raise ValueError("no optimizer is sharded yet: call shard_optimizer(optimizer) first")
        loaded = self.sharded.load(saved)
        if self.mirror is not None:  # cut from saved where it is whole, else sent at the next exchange
            self.mirror.load(saved)
        by_tensor = {id(t): s for t, s in zip(self.sharded.tensors, loaded, strict=True)}
        for bucket in self.buckets:
            if bucket.master is None:
                continue
            bucket.master_from_params()
            for tensor in bucket.piece_tensors:
                master = by_tensor.get(id(tensor), {}).get("_master")
                if master is not None:
                    tensor.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.healed_from = state.get("zero_heal")

    def heal_state(self) -> dict[str, Any]:
        """What a heal keeps, read on this rank alone: the counters, this rank's own shard and its
        buddy's mirror, each with its weights, and the optimizer steps they are at (see
        :func:`~lightning_mpi.rules.zero.mirror.rebuild_shards`). Raises ``LookupError`` without a
        mirror (the strategy's ``heal`` was not set when the optimizer was sharded)."""
        if self.sharded is None or self.mirror is None:
            raise LookupError(
                "ZeRO keeps the only copy of each rank's optimizer shard on that rank unless heal is set when the "
                "optimizer is sharded (its buddy copy)"
            )
        if self.mirror.stale:
            raise LookupError(
                "ZeRO's buddy copies were not sent yet after loading this rank's own optimizer shard (they go with "
                "the first exchange)"
            )
        return {
            **self.state_dict(),
            "zero_heal": {
                "steps": self.optimizer_steps,
                "whole": self.whole,
                "own": self.mirror.sharded_state(),
                "mirror": self.mirror.state(),
            },
        }

    def stats(self) -> dict[str, float]:
        """The last step's exchange seconds (reduce-scatter waits, norm, Allgather), bytes this rank
        sent (ASA's: Alltoall and Allgather), and the skipped steps so far."""
        return dict(self._last) if self._last else {"skipped_steps": float(self.skipped_steps)}

    def _wire_bytes(self) -> int:
        world = self.transport.size
        if world == 1:
            return 0
        word = torch.empty((), dtype=self.codec.wire_dtype).element_size()
        return sum(2 * (world - 1) * self.codec.wire_numel(b.plan.chunk) * word for b in self.buckets)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.schedule.close()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self.team is not self.transport:
            self.team.free()


class ShardGradNorm:
    """The global gradient norm of one ZeRO binding's buckets (see the module docstring)."""

    def __init__(self, transport: Transport, buckets: Sequence[ShardBucket]) -> None:
        self._transport = transport
        self._buckets = buckets
        self._norm_sq: tuple[float, tuple[int, ...]] | None = None  # global sum of squares, grad versions

    def agree(self) -> float:
        """The global sum of squares of the averaged gradients (a collective), kept for :meth:`clip_`."""
        total = self.global_sum(lambda g: torch.linalg.vector_norm(g).double().square(), "sum")
        self._norm_sq = (total, self._grad_versions())
        return total

    def clip_(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> tuple[float, Tensor]:
        """Scale every bucket's gradient as ``torch.nn.utils.clip_grad_norm_`` would the whole
        model's. Returns the coefficient applied and the total norm (as torch returns it)."""
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise ValueError(f"norm_type={norm_type!r} must be > 0 (or inf)")
        if norm_type == 2.0 and self._norm_sq is not None and self._norm_sq[1] == self._grad_versions():
            total = math.sqrt(self._norm_sq[0]) if self._norm_sq[0] >= 0 else float("nan")
        elif math.isinf(norm_type):
            total = self.global_sum(lambda g: g.abs().max() if g.numel() else g.new_zeros(()), "max")
        else:
            total = self.global_sum(lambda g: torch.linalg.vector_norm(g, norm_type).double() ** norm_type, "sum")
            total = total ** (1.0 / norm_type)
        if error_if_nonfinite and not math.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from the sharded optimizer is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        coefficient = min(max_norm / (total + 1e-6), 1.0) if math.isfinite(total) else max_norm / (total + 1e-6)
        for bucket in self._buckets:
            bucket.grad.mul_(coefficient)
        return coefficient, torch.tensor(total, dtype=torch.float32)

    def global_sum(self, local: Callable[[Tensor], Tensor], op: str) -> float:
        """``op`` ("sum" or "max") over ranks of ``local(grad)`` summed (or maxed) over this rank's buckets."""
        values = [local(b.grad) for b in self._buckets]
        acc = torch.zeros((), dtype=torch.float64)
        for v in values:
            v = v.to("cpu", torch.float64)
            acc = acc + v if op == "sum" else torch.maximum(acc, v)
        flag = acc.reshape(1).clone()
        if self._transport.size > 1:
            self._transport.allreduce_(flag, op)
        return float(flag.item())

    def _grad_versions(self) -> tuple[int, ...]:
        return tuple(b.grad._version for b in self._buckets)
