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
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.buffers import Bucket, make_buckets
from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.collectives import ASAWorkspace, allreduce_mean_, asa_mean_
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.base import BoundRule, Rule, check_choice, check_range

EXCHANGES = ("allreduce", "asa")
WIRES = ("fp32", "fp16", "bf16")
AVERAGES = ("gradients", "weights", "weights+momentum")


class SyncRule(Rule):
    """Average every step.

    Args:
        exchange: ``"allreduce"`` (one MPI_Allreduce) or ``"asa"`` (Alltoall → fp32 sum → Allgather).
        wire: ``"fp32"``, ``"fp16"`` or ``"bf16"``: the format on the wire. 16-bit formats need
            ``exchange="asa"``, which sums in fp32 after the wire.
        average: ``"gradients"``, ``"weights"`` or ``"weights+momentum"`` (see module docstring).
        bucket_mb: size of one exchange bucket in MiB, > 0.
    """

    name = "sync"

    def __init__(
        self,
        exchange: str = "allreduce",
        wire: str = "fp32",
        average: str = "gradients",
        bucket_mb: float = 25.0,
    ) -> None:
        check_choice("exchange", exchange, EXCHANGES)
        check_choice("wire", wire, WIRES)
        check_choice("average", average, AVERAGES)
        check_range("bucket_mb", bucket_mb, 0, float("inf"), low_open=True, high_open=True)
        if wire != "fp32" and exchange != "asa":
            raise ValueError(
                f"wire={wire!r} needs exchange='asa' (ASA sums 16-bit chunks in fp32); got exchange={exchange!r}"
            )
        self.exchange = exchange
        self.wire = wire
        self.average = average
        self.bucket_mb = float(bucket_mb)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> "BoundSyncRule":
        return BoundSyncRule(self, transport, params)


class BucketExchanger:
    """Averages padded buckets over ranks with the rule's exchange and codec, reusing scratch."""

    def __init__(self, transport: Transport, exchange: str, wire: str) -> None:
        self.transport = transport
        self.exchange = exchange
        self.codec = get_codec(wire)
        self._workspaces: dict[int, ASAWorkspace] = {}
        self.seconds = 0.0
        self.wire_bytes = 0

    def wire_bytes_for(self, bucket: Bucket) -> int:
        """Bytes this rank sends for one exchange of ``bucket`` (bandwidth-optimal algorithms)."""
        world = self.transport.size
        if world == 1:
            return 0
        elem = bucket.flat.element_size()
        if self.exchange == "allreduce":
            return int(2 * (world - 1) / world * bucket.flat.numel() * elem)
        chunk = bucket.flat.numel() // world
        words = self.codec.wire_numel(chunk) * (torch.empty((), dtype=self.codec.wire_dtype).element_size())
        return 2 * (world - 1) * words  # Alltoall out + Allgather out

    def __call__(self, bucket: Bucket) -> None:
        if self.transport.size == 1:
            return
        start = time.perf_counter()
        if self.exchange == "allreduce":
            allreduce_mean_(self.transport, bucket.flat)
        else:
            work = self._workspaces.get(id(bucket.flat))
            if work is None:
                work = ASAWorkspace.for_buffer(bucket.flat, self.transport.size, self.codec)
                self._workspaces[id(bucket.flat)] = work
            asa_mean_(self.transport, bucket.flat, self.codec, work)
        self.seconds += time.perf_counter() - start
        self.wire_bytes += self.wire_bytes_for(bucket)


def all_finite(buffers: Sequence[Tensor]) -> bool:
    """True when no buffer holds inf or NaN. One float64 sum per buffer: NaN or inf anywhere makes
    it non-finite, and float64 cannot overflow on float32 inputs."""
    return all(bool(torch.isfinite(b.sum(dtype=torch.float64))) for b in buffers)


class BoundSyncRule(BoundRule):
    def __init__(self, rule: SyncRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        self.rule = rule
        bucket_bytes = int(rule.bucket_mb * 2**20)
        self.buckets = make_buckets(self.params, transport.size, bucket_bytes)
        self.exchanger = BucketExchanger(transport, rule.exchange, rule.wire)
        self.skipped_steps = 0
        self.exchange_count = 0  # updating steps that exchanged gradients
        self._state_buckets: list[Bucket] = []
        self._state_key: tuple = ()
        self._last: dict[str, float] = {}

    # -- gradients -----------------------------------------------------------------------------
    def before_step(self, optimizer: Optimizer) -> bool:
        self.exchanger.seconds, self.exchanger.wire_bytes = 0.0, 0
        if self.transport.size == 1:
            return True
        if self.rule.average == "gradients":
            members = {id(p) for g in optimizer.param_groups for p in g["params"]}
            buckets = [b for b in self.buckets if any(id(t) in members for t in b.tensors)]
            self.exchange_count += 1
            for bucket in buckets:
                bucket.pack_grads()
                self.exchanger(bucket)
            finite = all_finite([b.flat for b in buckets])
            if finite:
                for bucket in buckets:
                    bucket.unpack_grads()
        else:
            # Local steps: skip together if any rank's own gradient is non-finite, so that the
            # weights averaged afterwards never carry inf/NaN from one rank into all.
            local = all_finite([p.grad for p in self.params if p.grad is not None])
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
        return finite

    # -- weights ---------------------------------------------------------------------------------
    def after_step(self, optimizer: Optimizer) -> None:
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

    def _momentum_buckets(self, optimizer: Optimizer) -> list[Bucket]:
        """Buckets over the optimizer's per-parameter float state (momentum, Adam moments).

        Built on first use (the state exists only after the first step) and rebuilt only when
        the set of state tensors changes.
        """
        tensors = []
        for p in self.params:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
                    tensors.append(value)
        key = tuple(id(t) for t in tensors)
        if key != self._state_key:
            self._state_buckets = make_buckets(tensors, self.transport.size, int(self.rule.bucket_mb * 2**20))
            self._state_key = key
        return self._state_buckets

    # -- bookkeeping -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def stats(self) -> dict[str, float]:
        return {
            "exchange_seconds": self.exchanger.seconds,
            "wire_bytes": float(self.exchanger.wire_bytes),
            "skipped_steps": float(self.skipped_steps),
        }
