"""Synchronous gradient averaging with lossy compression and error feedback.

Three wire formats, every one usable by every synchronous step:

- ``"int8"``: ASA with per-chunk min-max 8-bit quantization (fp32 sums, one rounding of the sum);
- ``"onebit"``: ASA with one sign bit per value and two per-chunk scales;
- ``"topk"``: each rank sends its ``ratio`` largest-magnitude entries as (index, value) pairs,
  one Allgather, local scatter-add (ranks choose different entries, so there is no ASA chunk).

With ``error_feedback`` (the default) what a rank did not send is kept in a residual and added to
its next gradient; the owner of an ASA chunk also keeps the residual of re-encoding the chunk's
mean. Summed over steps, the applied updates plus the pending residuals equal the mean of the
gradients. Residuals are part of :meth:`BoundCompressedSync.state_dict`, so a checkpoint resumes
them. ``momentum_correction`` (top-k only) is Deep Gradient Compression's: momentum is accumulated
locally before selection and masked where entries were sent; use it with an optimizer *without*
momentum. ``ratio_warmup_steps`` lowers the top-k ratio geometrically from 1 to ``ratio`` over the
first steps (DGC's exponential warm-up, per step).

At world size 1 nothing crosses a wire, so nothing is compressed.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.buffers import Bucket
from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.collectives import ASAWorkspace, asa_mean_steps, segments
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.sparse import TopKWorkspace, topk_count, topk_mean_steps
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.bucket_exchanger import BucketExchanger
from lightning_mpi.rules.sync import BoundSync, SyncRule


@options_class
class CompressedSyncRule(SyncRule):
    """Average gradients every step with a lossy wire format and error feedback (see the module docstring).

    Registered as ``mpi_asa_int8``, ``mpi_topk`` and ``mpi_onebit``.
    """

    name = "compressed"

    codec: Literal["int8", "topk", "onebit"] = option(
        default="int8",
        doc='`"int8"` (ASA with per-chunk min-max 8-bit quantization, fp32 sums), `"topk"` (each rank sends '
        'its `ratio` largest-magnitude entries as (index, value) pairs) or `"onebit"` (ASA with signs and two '
        "per-chunk scales).",
    )
    ratio: float = option(
        default=0.01, doc='fraction of entries `"topk"` sends, in (0, 1].', check=number(0.0, 1.0, low_open=True)
    )
    error_feedback: bool = option(
        default=True,
        doc="keep what was not sent and add it to the next step's gradient; the residuals are saved in checkpoints.",
    )
    momentum_correction: bool = option(
        default=False,
        doc='Deep Gradient Compression\'s momentum correction (`codec="topk"` only): momentum is applied locally '
        "before sparsification, so use an optimizer without momentum.",
    )
    momentum: float = option(
        default=0.9, doc="the momentum of `momentum_correction`, in [0, 1).", check=number(0.0, 1.0, high_open=True)
    )
    ratio_warmup_steps: int = option(
        default=0,
        doc="steps over which the top-k ratio falls geometrically from 1 to `ratio` (0: none).",
        check=integer(0),
    )

    # Fixed for the lossy codecs: ASA carries their chunks, the codec is the wire, gradients are averaged.
    exchange: Literal["allreduce", "asa"] = field(default="asa", init=False)
    wire: Literal["fp32", "fp16", "bf16"] = field(default="fp32", init=False)
    average: Literal["gradients", "weights", "weights+momentum"] = field(default="gradients", init=False)
    topology_aware: bool = field(default=False, init=False)

    def check_together(self) -> None:
        if self.momentum_correction and self.codec != "topk":
            raise ValueError(
                "momentum_correction=True needs codec='topk' (DGC corrects momentum for sparsified exchange); "
                f"got codec={self.codec!r}"
            )

    def ratio_at(self, step: int) -> float:
        """Top-k ratio on update ``step`` (0-based): geometric warm-up from 1 to ``ratio``."""
        if step >= self.ratio_warmup_steps:
            return self.ratio
        return self.ratio ** (step / self.ratio_warmup_steps)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundCompressedSync:
        return BoundCompressedSync(self, transport, params)


@dataclass
class _SegmentState:
    """Feedback buffers of one exchanged segment (views into per-bucket buffers)."""

    residual: Tensor | None  # like the segment: this rank's unsent part
    owner_residual: Tensor | None  # one chunk (ASA): unsent part of the mean this rank owns
    momentum: Tensor | None  # like the segment (top-k with momentum correction)
    numel: int  # real (unpadded) entries, for k


class CompressedExchanger(BucketExchanger):
    """:class:`BucketExchanger` whose exchanges compress, with error feedback buffers per bucket."""

    def __init__(self, transport: Transport, rule: CompressedSyncRule) -> None:
        super().__init__(
            transport,
            exchange="asa",
            wire="fp32",
            segment_mb=rule.segment_mb,
            progress_thread=rule.overlap and rule.progress_thread,
            topology_aware=False,
        )
        self.rule = rule
        self.topk = rule.codec == "topk"
        if not self.topk:
            self.codec = get_codec(rule.codec)
        self.step = 0  # updating steps so far (top-k warm-up)
        #: per bucket (by index): this rank's residual, owned-chunk residuals, momentum
        self.residuals: list[Tensor] = []
        self.owner_residuals: list[Tensor] = []
        self.momenta: list[Tensor] = []
        self._states: dict[tuple[int, int], _SegmentState] = {}
        self._topk_work: dict[tuple[int, int], TopKWorkspace] = {}

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        world = self.transport.size
        rule = self.rule
        for bucket in buckets:
            flat = bucket.flat
            team = self.transport.dup()
            if self.topk:
                parts = [flat]
            else:
                parts = segments(flat, world, self.segment_numel)
            self._slots[id(bucket)] = (None, parts, [team] + [team.dup() for _ in parts[1:]])
            residual = torch.zeros_like(flat) if rule.error_feedback else None
            owner = torch.zeros(flat.numel() // world, dtype=flat.dtype, device=flat.device)
            momentum = torch.zeros_like(flat) if rule.momentum_correction else None
            self.residuals.append(residual if residual is not None else flat.new_zeros(0))
            self.owner_residuals.append(owner if rule.error_feedback and not self.topk else flat.new_zeros(0))
            self.momenta.append(momentum if momentum is not None else flat.new_zeros(0))
            start = owner_start = 0
            for part in parts:
                n = part.numel()
                chunk = n // world
                self._states[(part.data_ptr(), n)] = _SegmentState(
                    residual=None if residual is None else residual[start : start + n],
                    owner_residual=None if residual is None or self.topk else owner[owner_start : owner_start + chunk],
                    momentum=None if momentum is None else momentum[start : start + n],
                    numel=min(n, max(0, bucket.numel - start)),
                )
                start += n
                owner_start += chunk

    def current_ratio(self) -> float:
        return self.rule.ratio_at(self.step)

    def wire_bytes_for(self, bucket: Bucket) -> int:
        world = self.transport.size
        if world == 1:
            return 0
        if not self.topk:
            return super().wire_bytes_for(bucket)
        k = topk_count(bucket.numel, self.current_ratio())
        return (world - 1) * 2 * k * 4  # Allgather out: k int32 indices + k float32 values

    def dense_bytes_for(self, bucket: Bucket) -> int:
        """What fp32 ASA would send for ``bucket`` (for the compression factor)."""
        world = self.transport.size
        return 2 * (world - 1) * (bucket.flat.numel() // world) * 4 if world > 1 else 0

    def _segment_steps(self, team: Transport, segment: Tensor) -> Exchange:
        key = (segment.data_ptr(), segment.numel())
        state = self._states[key]
        if self.topk:
            k = topk_count(state.numel, self.current_ratio())
            topk_work = self._topk_work.get(key)
            if topk_work is None:
                topk_work = self._topk_work[key] = TopKWorkspace(
                    k, team.size, segment.device, segment.numel(), segment.dtype
                )
            topk_work.resize(k)  # new wire buffers only while the warm-up changes k
            return topk_mean_steps(team, segment, k, topk_work, state.residual, state.momentum, self.rule.momentum)
        work = self._workspaces.get(key)
        if work is None:
            work = self._workspaces[key] = ASAWorkspace.for_buffer(segment, team.size, self.codec)
        return self._clean_padding(
            asa_mean_steps(team, segment, self.codec, work, state.residual, state.owner_residual), segment, state, team
        )

    @staticmethod
    def _clean_padding(steps: Exchange, segment: Tensor, state: _SegmentState, team: Transport) -> Exchange:
        """Run ``steps``, then zero the padding again: a 1-bit row decodes its zeros to ``±scale``,
        which must not linger in the bucket or its residuals and shift the next step's scales."""
        yield from steps
        n = state.numel
        if n < segment.numel():
            segment[n:].zero_()
            if state.residual is not None:
                state.residual[n:].zero_()
            if state.owner_residual is not None:
                chunk = state.owner_residual.numel()
                state.owner_residual[min(chunk, max(0, n - team.rank * chunk)) :].zero_()


class BoundCompressedSync(BoundSync):
    """Running :class:`CompressedSyncRule`: gradient hooks and skipping as in sync, plus residuals."""

    rule: CompressedSyncRule
    exchanger: CompressedExchanger

    def __init__(self, rule: CompressedSyncRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(rule, transport, params)
        self._warned_momentum = False
        self.dense_bytes = 0

    def make_exchanger(self, transport: Transport, rule: SyncRule) -> BucketExchanger:
        assert isinstance(rule, CompressedSyncRule)
        return CompressedExchanger(transport, rule)

    def before_step(self, optimizer: Optimizer) -> bool:
        if self.rule.momentum_correction and not self._warned_momentum:
            self._warned_momentum = True
            if any(g.get("momentum", 0) for g in optimizer.param_groups):
                warnings.warn(
                    "lightning_mpi: momentum_correction=True applies momentum before the exchange; "
                    "the optimizer should have momentum=0, or momentum is applied twice.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self.transport.size > 1:
            members = {id(p) for g in optimizer.param_groups for p in g["params"]}
            self.dense_bytes = sum(
                self.exchanger.dense_bytes_for(b) for b in self.buckets if any(id(t) in members for t in b.tensors)
            )
        finite = super().before_step(optimizer)
        if not finite:
            # The skipped step's inf/NaN must not live on in the feedback buffers.
            for buf in (*self.exchanger.residuals, *self.exchanger.owner_residuals, *self.exchanger.momenta):
                torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)
        if self.transport.size > 1:
            self.exchanger.step += 1
        return finite

    def _snapshot_stats(self) -> None:
        wire = self.exchanger.wire_bytes
        super()._snapshot_stats()
        self._last["dense_bytes"] = float(self.dense_bytes)
        self._last["compression"] = float(self.dense_bytes / wire) if wire else 1.0
        if self.exchanger.topk:
            self._last["ratio"] = self.exchanger.current_ratio()

    # -- checkpoints: residuals differ per rank, so every rank's go into the checkpoint ------------
    def _local_state(self) -> dict[str, Any]:
        ex = self.exchanger
        return {
            "residuals": [t.detach().cpu().clone() for t in ex.residuals],
            "owner_residuals": [t.detach().cpu().clone() for t in ex.owner_residuals],
            "momenta": [t.detach().cpu().clone() for t in ex.momenta],
        }

    def state_dict(self) -> dict[str, Any]:
        """Collective on every rank (Lightning saves checkpoints on all ranks; rank 0 writes)."""
        state = super().state_dict()
        state["step"] = self.exchanger.step
        state["world_size"] = self.transport.size
        state["codec"] = self.rule.codec
        if self.transport.size > 1:
            state["ranks"] = self.transport.allgather_object(self._local_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.exchanger.step = int(state.get("step", 0))
        ranks = state.get("ranks")
        if not ranks or self.transport.size == 1:
            return
        ex = self.exchanger
        if state.get("codec") != self.rule.codec:
            warnings.warn(
                f"lightning_mpi: checkpoint residuals are for codec={state.get('codec')!r}, not "
                f"{self.rule.codec!r}; starting with empty residuals.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if int(state.get("world_size", 0)) == self.transport.size:
            mine = ranks[self.transport.rank]
            for name in ("residuals", "owner_residuals", "momenta"):
                for dst, src in zip(getattr(ex, name), mine[name], strict=True):
                    if dst.shape != src.shape:
                        raise ValueError(
                            f"checkpoint {name} of shape {tuple(src.shape)} do not fit buffers of {tuple(dst.shape)}"
                        )
                    dst.copy_(src)
            return
        # Another world size: the pending mass of the mean update is mean(residuals); every rank
        # gets that mean, which keeps it. Owned-chunk residuals depend on the chunking: dropped.
        warnings.warn(
            f"lightning_mpi: checkpoint from {state.get('world_size')} ranks restored on {self.transport.size}: "
            "residuals are averaged, owned-chunk residuals dropped.",
            RuntimeWarning,
            stacklevel=2,
        )
        for name in ("residuals", "momenta"):
            for i, dst in enumerate(getattr(ex, name)):
                parts = [r[name][i] for r in ranks]
                n = min(dst.numel(), *(p.numel() for p in parts))
                if n:
                    dst.zero_()
                    dst[:n].copy_(torch.stack([p[:n] for p in parts]).mean(dim=0))

    def stats(self) -> dict[str, float]:
        return dict(self._last)


__all__ = ["BoundCompressedSync", "CompressedExchanger", "CompressedSyncRule"]
