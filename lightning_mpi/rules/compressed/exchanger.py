"""The exchanger of the compressed synchronous rules (:mod:`.rule`): each bucket's segments
exchanged with compression (int8 or 1-bit on ASA, top-k by one Allgather), with this rank's error
feedback buffers per bucket (its residual, the owned chunks' residuals, DGC's velocity) and top-k's
local clipping, warm-up and layer-wise selection, as the rule's options ask. The rule, its options
and its checkpoints are in :mod:`.rule`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import Bucket
from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.collectives import ASAWorkspace, asa_mean_steps, segments
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.sparse import (
    Section,
    TopKWorkspace,
    delta16_counts,
    delta16_fillers,
    section_counts,
    topk_count,
    topk_mean_steps,
)
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.buckets import BucketExchanger
from lightning_mpi.rules.compressed.momentum_handoff import DGC_MOMENTUM


class CompressionOptions(Protocol):
    """What the exchanger reads of its rule, :class:`~lightning_mpi.rules.compressed.rule.CompressedSyncRule`
    (a protocol, so that the rule's module imports this one and not the other way round)."""

    @property
    def wire(self) -> str: ...
    @property
    def error_feedback(self) -> bool: ...
    @property
    def momentum(self) -> float | None: ...
    @property
    def momentum_masking(self) -> bool: ...
    @property
    def layerwise(self) -> bool: ...
    @property
    def topk_packing(self) -> str: ...
    @property
    def clip_norm(self) -> float | None: ...
    @property
    def segment_mb(self) -> float: ...
    @property
    def overlap(self) -> bool: ...
    @property
    def progress_thread(self) -> bool: ...
    @property
    def corrects_momentum(self) -> bool: ...
    def ratio_at(self, step: int) -> float: ...


@dataclass
class _SegmentState:
    """Feedback buffers of one exchanged segment (views into per-bucket buffers)."""

    residual: Tensor | None  # like the segment: this rank's unsent part
    owner_residual: Tensor | None  # one chunk (ASA): unsent part of the mean this rank owns
    momentum: Tensor | None  # like the segment (top-k with momentum correction)
    numel: int  # real (unpadded) entries, for k
    sizes: list[int] = field(default_factory=list)  # top-k, layer-wise: the members' sizes, in order
    clip: float = 0.0  # top-k local clipping: this segment's norm threshold (0: none)
    length: int = 0  # entries of the segment, padding included ("delta16" gaps span it)


def clip_(grad: Tensor, max_norm: float) -> None:
    """Scale ``grad`` in place to an L2 norm of at most ``max_norm`` (as ``clip_grad_norm_``: no
    host sync; a non-finite gradient stays non-finite, and the step is skipped on every rank)."""
    norm = torch.linalg.vector_norm(grad)
    grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


class CompressedExchanger(BucketExchanger):
    """:class:`BucketExchanger` whose exchanges compress, with error feedback buffers per bucket."""

    def __init__(self, transport: Transport, rule: CompressionOptions) -> None:
        super().__init__(
            transport,
            exchange="asa",
            wire="fp32",
            segment_mb=rule.segment_mb,
            progress_thread=rule.overlap and rule.progress_thread,
            topology_aware=False,
        )
        self.rule = rule
        self.topk = rule.wire == "topk"
        if not self.topk:
            self.codec = get_codec(rule.wire)
        self.step = 0  # updating steps so far (top-k warm-up)
        #: the ``m`` of momentum correction: the rule's, else the optimizer's (set at its first step;
        #: the first exchange does not need it, momentum buffers are still zero then)
        self.momentum = rule.momentum if rule.momentum is not None else DGC_MOMENTUM
        #: per bucket (by index): this rank's residual, owned-chunk residuals, momentum
        self.residuals: list[Tensor] = []
        self.owner_residuals: list[Tensor] = []
        self.momenta: list[Tensor] = []
        self._states: dict[tuple[int, int], _SegmentState] = {}
        self._topk_work: dict[tuple[int, int], TopKWorkspace] = {}
        #: an exchange started since the last one completed: the feedback buffers may be half-updated
        self.in_flight = False
        self.started = 0  # buckets of that exchange started (each encodes this rank's part at once)

    def start(self, bucket: Bucket, on_done: Callable[[Bucket], None] | None = None) -> None:
        if self.transport.size > 1:
            self.in_flight = True  # before the exchange's first step updates a residual
        super().start(bucket, on_done)
        if self.transport.size > 1:
            self.started += 1

    def prepare(self, buckets: Sequence[Bucket]) -> None:
        world = self.transport.size
        rule = self.rule
        total = sum(bucket.numel for bucket in buckets)
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
            momentum = torch.zeros_like(flat) if rule.corrects_momentum else None
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
                    sizes=[t.numel() for t in bucket.tensors] if self.topk and rule.layerwise else [],
                    clip=self._clip_threshold(bucket.numel, total) if self.topk else 0.0,
                    length=n,
                )
                start += n
                owner_start += chunk

    def _clip_threshold(self, numel: int, total: int) -> float:
        """DGC's local threshold: the global ``clip_norm`` times ``N^-1/2`` (the share of one of N ranks
        with alike gradients), times ``sqrt(numel / total)`` (a bucket's share: buckets leave during
        backward, before this rank's whole gradient exists)."""
        if self.rule.clip_norm is None or not total:
            return 0.0
        return self.rule.clip_norm * math.sqrt(numel / total / self.transport.size)

    def release_momentum(self) -> None:
        """Drop the momentum buffers (the optimizer has no momentum: ``m = 0`` needs none)."""
        for state in self._states.values():
            state.momentum = None
        self.momenta = [t.new_zeros(0) for t in self.momenta]

    def current_ratio(self) -> float:
        return self.rule.ratio_at(self.step)

    def wire_bytes_for(self, bucket: Bucket) -> int:
        world = self.transport.size
        if world == 1:
            return 0
        if not self.topk:
            return super().wire_bytes_for(bucket)
        state = self._states[(bucket.flat.data_ptr(), bucket.flat.numel())]
        words = self._row_words(state, sum(self._sections(state)[1]))
        return (world - 1) * words * 4  # Allgather out: k int32 indices + k float32 values, or k "delta16" words

    def _sections(self, state: _SegmentState) -> tuple[list[Section] | None, list[int]]:
        """The selection's sections (None: the whole segment) and their ``k`` at the current ratio."""
        ratio = self.current_ratio()
        if not state.sizes:
            k = topk_count(state.numel, ratio)
            if self.rule.topk_packing == "delta16":  # the words of k pairs, one entry a word
                k = min(state.numel, delta16_counts(state.length, 2 * k))
            return None, [k]
        counts = section_counts(state.sizes, ratio)
        offsets = itertools.accumulate(state.sizes[:-1], initial=0)
        return [(o, n, k) for o, n, k in zip(offsets, state.sizes, counts, strict=True)], counts

    def _row_words(self, state: _SegmentState, k: int) -> int:
        """32-bit words a rank sends for ``k`` entries."""
        if self.rule.topk_packing == "delta16":
            return k + delta16_fillers(state.length)
        return 2 * k

    def dense_bytes_for(self, bucket: Bucket) -> int:
        """What fp32 ASA would send for ``bucket`` (for the compression factor)."""
        world = self.transport.size
        return 2 * (world - 1) * (bucket.flat.numel() // world) * 4 if world > 1 else 0

    def _segment_steps(self, team: Transport, segment: Tensor) -> Exchange:
        key = (segment.data_ptr(), segment.numel())
        state = self._states[key]
        if self.topk:
            sections, counts = self._sections(state)
            k = sum(counts)
            if state.clip:
                clip_(segment, state.clip)
            topk_work = self._topk_work.get(key)
            if topk_work is None:
                topk_work = self._topk_work[key] = TopKWorkspace(
                    k, team.size, segment.device, segment.numel(), segment.dtype
                )
            topk_work.resize(k, self._row_words(state, k))  # new wire buffers only while the warm-up changes k
            return topk_mean_steps(
                team,
                segment,
                k,
                topk_work,
                state.residual,
                state.momentum,
                self.momentum,
                sections,
                self.rule.momentum_masking,
                self.rule.topk_packing,
            )
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
