"""Synchronous data parallelism: every rank applies the same averaged update every step.

``average="gradients"`` (the default) averages gradients after backward and before the optimizer
step, so W ranks with batch B follow the same trajectory as one process with batch W·B.
``average="weights"`` is Theano-MPI's AWAGD ("avg"): each rank steps on its own gradient, then
the weights are averaged; ``"weights+momentum"`` also averages the optimizer's per-parameter
state (momentum buffers, Adam moments), which keeps replicas from drifting apart in their
optimizer state.

The exchange is either one ``MPI_Allreduce`` or Theano-MPI's Alltoall-sum-Allgather (ASA), with
fp32, fp16 or bf16 on the wire. A step whose exchanged gradients contain inf or NaN is skipped on
every rank (they all see the same values), counted in ``skipped_steps`` and warned about.

Healing (``heal="shrink"``/``"replace"``): a survivor keeps its counters (:meth:`~.BoundRule.heal_state`,
the checkpoint state). The exchange of ``before_step`` is redone on the healed run with this rank's own
gradients put back (an interrupted exchange may have averaged some buckets), or its result taken
from a survivor that completed it (:func:`~.base.gradient_exchange`); the weight average of
``after_step`` (``average="weights"``/``"weights+momentum"``) is redone from the weights, and the
optimizer's moments, it started from (:func:`~.base.redone_from_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.buffers import Bucket, make_buckets
from lightning_mpi.comm.errors import ProcessFailed
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import option, options_class
from lightning_mpi.rules.base import (
    BoundRule,
    Execute,
    all_finite,
    gradient_exchange,
    grads_finite,
    redone_from_state,
)
from lightning_mpi.rules.buckets import BucketExchanger, SegmentedBuckets
from lightning_mpi.rules.exposed_warning import ExposedExchangeWarning
from lightning_mpi.rules.zero.rule import ZeroRule


@options_class
class SyncRule(SegmentedBuckets):
    """Synchronous data parallelism: every step, average gradients (or weights) over all ranks.

    Registered as ``mpi_allreduce``, ``mpi_asa``, ``mpi_asa16`` and ``mpi_asa_bf16``.
    """

    name = "sync"

    exchange: Literal["allreduce", "asa"] = option(
        default="allreduce",
        doc='`"allreduce"`: one MPI_Allreduce per bucket; `"asa"`: Theano-MPI\'s Alltoall, local fp32 sum, Allgather.',
    )
    wire: Literal["fp32", "fp16", "bf16"] = option(
        default="fp32",
        doc='the format on the wire; 16-bit formats need `exchange="asa"`, which sums in fp32: half the '
        "bytes, one rounding of the sum.",
    )
    average: Literal["gradients", "weights", "weights+momentum"] = option(
        default="gradients",
        doc='`"gradients"` (W ranks x batch B = one process x batch W*B), `"weights"` (Theano-MPI\'s '
        'AWAGD: local step, then average weights) or `"weights+momentum"` (also average the optimizer\'s '
        "momentum and moment buffers).",
    )
    topology_aware: bool = option(
        default=False,
        doc="reduce within each node over shared memory, exchange among node leaders only, then broadcast "
        "within the node (PowerAI DDL's scheme).",
    )

    shard_optimizer: bool = option(
        default=False,
        doc='ZeRO stages 1 and 2 (needs `exchange="asa"`): ASA\'s Alltoall and sum are a reduce-scatter, so each '
        "rank steps only its shard of the parameters with optimizer state only for it, and the Allgather carries "
        "the weights: the same bytes, optimizer state and kept gradients / W. One optimizer, element-wise (SGD, "
        "Adam, AdamW, RMSprop, Adagrad, ...); checkpoints are sharded directories.",
    )

    def check_together(self) -> None:
        if self.shard_optimizer and (self.exchange != "asa" or self.average != "gradients" or self.topology_aware):
            raise ValueError(
                f"shard_optimizer=True needs exchange='asa', average='gradients' and topology_aware=False (ASA's "
                f"Alltoall and sum is the reduce-scatter it steps the shards after); got exchange={self.exchange!r}, "
                f"average={self.average!r}, topology_aware={self.topology_aware!r}"
            )
        if self.wire != "fp32" and self.exchange != "asa":
            raise ValueError(
                f"wire={self.wire!r} needs exchange='asa' (ASA sums 16-bit chunks in fp32); "
                f"got exchange={self.exchange!r}"
            )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundRule:
        if self.shard_optimizer:
            zero = ZeroRule(
                wire=self.wire, bucket_mb=self.bucket_mb, overlap=self.overlap, progress_thread=self.progress_thread
            )
            return zero.bind(transport, params)
        return BoundSync(self, transport, params)


class BoundSync(BoundRule):
    def __init__(self, rule: SyncRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        self.rule = rule
        self.exchanger = self.make_exchanger(transport, rule)
        self.buckets = make_buckets(
            self.params,
            self.exchanger.pad_multiple,
            bucket_bytes=rule.bucket_bytes(),
            first_bucket_bytes=rule.first_bucket_bytes(),
        )
        if transport.size > 1:
            self.exchanger.prepare(self.buckets)
        self.skipped_steps = 0
        self.exchange_count = 0  # updating steps that exchanged gradients
        self._last: dict[str, float] = {}
        self.hook_launches = 0  # buckets whose exchange started during backward
        self._state_buckets: list[Bucket] = []
        self._state_key: tuple = ()
        # Overlap state: how many members of each bucket reported a gradient in this backward.
        self.sync_enabled = True  # False while Lightning accumulates (block_backward_sync)
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._replayed = False  # a gradient arrived after its bucket left: redo blocking
        self._arrived: list[Bucket] = []  # exchanged buckets not yet unpacked, in arrival order
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._hook_failure: ProcessFailed | None = None  # a dead rank noticed by a gradient hook
        if rule.overlap and rule.average == "gradients" and transport.size > 1:
            self._attach_hooks()
        self.exposed_warning = ExposedExchangeWarning(
            f"the every-step {rule.exchange} exchange (wire={rule.wire})", transport.rank, transport.size
        )
        if rule.average != "gradients":  # exchanged after the step: no wait before it to time
            self.exposed_warning.disarm()

    def make_exchanger(self, transport: Transport, rule: SyncRule) -> BucketExchanger:
        """The exchanger for this rule's buckets; subclasses return their own (compressed rules)."""
        return BucketExchanger(
            transport,
            exchange=rule.exchange,
            wire=rule.wire,
            segment_mb=rule.segment_mb,
            progress_thread=rule.overlap and rule.progress_thread,
            topology_aware=rule.topology_aware,
        )

    def _attach_hooks(self) -> None:
        for index, bucket in enumerate(self.buckets):
            for tensor in bucket.tensors:
                self._hooks.append(tensor.register_post_accumulate_grad_hook(self._make_hook(index)))

    def _make_hook(self, index: int):
        def on_grad_ready(_param: Tensor) -> None:
            if not self.sync_enabled or self._hook_failure is not None:
                return
            self._ready[index] += 1
            bucket = self.buckets[index]
            try:
                if self._ready[index] == len(bucket.tensors):
                    bucket.pack_grads()
                    self._launched[index] = True
                    self.hook_launches += 1
                    self.exchanger.start(bucket, self._arrived.append)
                elif self._ready[index] > len(bucket.tensors):
                    self._replayed = True  # a second backward before the step
                self.exchanger.poll()  # MPICH moves data only inside MPI calls
            except ProcessFailed as failure:
                # A dead rank (ULFM) noticed during backward: backward completes, and the exchange
                # raises it, where a healing strategy redoes the exchange with whole gradients.
                self._hook_failure = failure

        return on_grad_ready

    def _reset_overlap(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._replayed = False
        self._arrived.clear()

    # -- gradients -----------------------------------------------------------------------------
    def _snapshot_stats(self) -> None:
        """Keep this step's numbers for ``stats()`` and start counting the next step."""
        self._last = {
            "exchange_seconds": self.exchanger.seconds,
            "wire_bytes": float(self.exchanger.wire_bytes),
            "skipped_steps": float(self.skipped_steps),
        }
        self.exchanger.seconds, self.exchanger.wire_bytes = 0.0, 0

    def before_step(self, optimizer: Optimizer) -> bool:
        if self.transport.size == 1:
            return True
        if self._hook_failure is not None:
            failure, self._hook_failure = self._hook_failure, None
            raise failure
        self.exposed_warning.wait_begins()
        if self.rule.average == "gradients":
            members = {id(p) for g in optimizer.param_groups for p in g["params"]}
            buckets = [b for b in self.buckets if any(id(t) in members for t in b.tensors)]
            self.exchange_count += 1
            if self._replayed:
                self.exchanger.finish()  # drop what left early: gradients changed since
                self._launched = [False] * len(self.buckets)
                self._arrived.clear()
            for bucket in buckets:
                # Buckets the hooks did not launch: overlap off, or a member got no gradient.
                if not self._launched[bucket.index]:
                    bucket.pack_grads()
                    self.exchanger.start(bucket, self._arrived.append)
            # Buckets are unpacked (and checked) as they arrive, while later ones are still on
            # the wire. Not earlier: during backward a second backward could still add to .grad.
            # Unpacked even when non-finite: a GradScaler (16-mixed) decides from .grad whether to
            # skip the step, and it must see the averaged values, which are the same on every
            # rank; this rank's own finite gradients would let it step while the others skip.
            wanted = {bucket.index for bucket in buckets}
            finite_by_bucket: dict[int, bool] = {}

            def unpack_arrived() -> None:
                while self._arrived:
                    bucket = self._arrived.pop(0)
                    if bucket.index in wanted:
                        bucket.unpack_grads()
                        finite_by_bucket[bucket.index] = all_finite([bucket.flat])

            unpack_arrived()
            self.exchanger.finish(unpack_arrived)
            unpack_arrived()
            self._reset_overlap()
            finite = all(finite_by_bucket.get(index, False) for index in wanted)
        else:
            # Local steps: skip together if any rank's own gradient is non-finite, so that the
            # weights averaged afterwards never carry inf/NaN from one rank into all.
            local = grads_finite(self.params)
            flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float64)
            finite = bool(self.transport.allreduce_(flag, "min").item() == 1.0)
        if not finite:
            self.skipped_steps += 1
            warnings.warn(
                f"lightning_mpi: non-finite gradients after the exchange (wire={self.rule.wire}); "
                f"skipping this optimizer step on every rank ({self.skipped_steps} skipped so far).",
                RuntimeWarning,
                stacklevel=2,
            )
        if self.rule.average == "gradients":
            self._snapshot_stats()
        self.exposed_warning.wait_ends()
        return finite

    # -- weights ---------------------------------------------------------------------------------
    def after_step(self, optimizer: Optimizer) -> None:
        self.exposed_warning.step_ends()
        if self.transport.size == 1 or self.rule.average == "gradients":
            return
        for bucket in self.buckets:
            bucket.pack()
            self.exchanger(bucket)
            bucket.unpack()
        if self.rule.average == "weights+momentum":
            for bucket in self._momentum_buckets(optimizer):
                bucket.pack()
                self.exchanger(bucket)
                bucket.unpack()
        self._snapshot_stats()

    def _momentum_buckets(self, optimizer: Optimizer) -> list[Bucket]:
        """Buckets over the optimizer's per-parameter float state (:func:`float_state`).

        Built on first use (the state exists only after the first step) and rebuilt only when
        the set of state tensors changes.
        """
        tensors = float_state(self.params, optimizer)
        key = tuple(id(t) for t in tensors)
        if key != self._state_key:
            self.exchanger.release(self._state_buckets)  # every rank is here at the same step
            self._state_buckets = make_buckets(tensors, self.exchanger.pad_multiple, int(self.rule.bucket_mb * 2**20))
            self._state_key = key
            self.exchanger.prepare(self._state_buckets)  # every rank is here at the same step
        return self._state_buckets

    # -- healing (module docstring) ----------------------------------------------------------------
    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        return execute(gradient_exchange(optimizer))

    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        if self.rule.average == "gradients":  # nothing goes over the wire here
            super().healable_after_step(optimizer, execute)
            return
        momentum = self.rule.average == "weights+momentum"
        execute(
            redone_from_state(
                "the weight average",
                lambda bound: bound.after_step(optimizer),
                moving=lambda bound: [*bound.params, *(float_state(bound.params, optimizer) if momentum else [])],
                exchanged=lambda bound, _before: bound.transport.size > 1,
                # the average writes the weights (and moments) bucket by bucket
                restore=True,
            )
        )

    # -- bookkeeping -----------------------------------------------------------------------------
    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.exchanger.close()

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def stats(self) -> dict[str, float]:
        return dict(self._last)


def float_state(params: Sequence[Tensor], optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's per-parameter float state of ``params`` (momentum buffers, Adam's moments:
    tensors shaped like their parameter), in a fixed order: what ``average="weights+momentum"``
    averages."""
    found = []
    for p in params:
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
                found.append(value)
    return found
