"""Where each rank's shard lies: buckets over the parameters, and the pieces of them a rank owns.

ZeRO on ASA (:mod:`lightning_mpi.rules.zero.rule`) lays the trainable parameters out in buckets, each a
flat run of parameter elements padded to a multiple of the world size ``W``. ASA's Alltoall and
local sum reduce a bucket so that rank ``r`` ends up with the summed gradient of the ``r``-th of its
``W`` equal chunks: ``[r·c, (r+1)·c)`` with ``c = padded / W``. A rank's shard is its chunk of every
bucket. Inside a chunk, the parameters that overlap it give :class:`Piece`\\ s: the element range
``[start, start + length)`` of one flattened parameter, placed at ``offset`` in the chunk. Each piece
becomes one tensor of the sharded optimizer.

Buckets follow :func:`~lightning_mpi.comm.buffers.make_buckets`' order (reverse registration order,
grouped by device and exchange dtype), with one difference: a parameter that would overflow the
open bucket is cut (one :class:`Segment` per bucket), so every bucket but the last of a group holds
exactly ``bucket_bytes``. ZeRO keeps no full-size bucket buffer, and the few buffers in flight are
sized by the largest bucket, which must not be the largest layer (a 200 MB embedding). Parameters
that are not contiguous in memory are never cut (no flat view of them exists): they go whole into
the open bucket, which may then exceed ``bucket_bytes``.

Everything here is integer arithmetic on (numel, dtype, device, contiguity) descriptions of the
parameters, so the partition can be worked out for any world size without tensors or MPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_mpi.comm.buffers import buffer_dtype, padded_numel


@dataclass(frozen=True)
class ParamSpec:
    """What the partition needs to know about one parameter."""

    numel: int
    dtype: torch.dtype
    device: torch.device
    contiguous: bool = True

    @classmethod
    def of(cls, tensor: torch.Tensor) -> ParamSpec:
        return cls(tensor.numel(), tensor.dtype, tensor.device, tensor.is_contiguous())


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + length)`` of flattened parameter ``param``, at ``offset`` in a bucket."""

    param: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: ``segments`` of parameters laid out one after the other.

    ``numel`` real elements, padded to ``chunk * world`` so that every rank owns ``chunk`` of them.
    ``dtype`` is the exchange (and summation) dtype: float64 for float64 parameters, else float32.
    """

    index: int
    segments: tuple[Segment, ...]
    numel: int
    chunk: int
    dtype: torch.dtype
    device: torch.device
    world: int

    @property
    def members(self) -> tuple[int, ...]:
        """The parameters with elements in this bucket, in layout order."""
        return tuple(dict.fromkeys(seg.param for seg in self.segments))

    @property
    def padded(self) -> int:
        """Length of the padded flat layout: ``chunk * world``."""
        return self.chunk * self.world


@dataclass(frozen=True)
class Piece:
    """The elements ``[start, start + length)`` of flattened parameter ``param`` that a rank owns;
    they sit at ``offset`` in its chunk of bucket ``bucket``."""

    param: int
    start: int
    length: int
    bucket: int
    offset: int


def plan_buckets(specs: Sequence[ParamSpec], world_size: int, bucket_bytes: int | None) -> list[BucketPlan]:
    """Lay parameters out in buckets of ``bucket_bytes`` (``None``: one bucket per group).

    Reverse registration order (backward produces gradients roughly last layer first, so the
    first bucket is ready first), one run of buckets per (device, exchange dtype). A contiguous
    parameter that overflows the open bucket is cut there and goes on in the next one.
    Parameters with no elements are left out: they own nothing and exchange nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be >= 1 or None")
    groups: dict[tuple[torch.device, torch.dtype], list[list[Segment]]] = {}
    fill: dict[tuple[torch.device, torch.dtype], int] = {}  # elements in the group's open bucket
    for index in reversed(range(len(specs))):
        spec = specs[index]
        key = (spec.device, buffer_dtype(spec.dtype))
        cap = None if bucket_bytes is None else max(1, bucket_bytes // torch.empty((), dtype=key[1]).element_size())
        runs = groups.setdefault(key, [])
        start = 0
        while start < spec.numel:
            if key not in fill:
                runs.append([])
                fill[key] = 0
            length = spec.numel - start
            if cap is not None and spec.contiguous:
                length = min(length, cap - fill[key])
            runs[-1].append(Segment(index, start, length, fill[key]))
            fill[key] += length
            start += length
            if cap is not None and fill[key] >= cap:
                del fill[key]
    plans: list[BucketPlan] = []
    for (device, dtype), runs in groups.items():
        for segments in runs:
            total = sum(seg.length for seg in segments)
            chunk = padded_numel(total, world_size) // world_size
            plans.append(BucketPlan(len(plans), tuple(segments), total, chunk, dtype, device, world_size))
    return plans


def chunk_range(plan: BucketPlan, rank: int) -> tuple[int, int]:
    """``[begin, end)`` of ``rank``'s chunk inside the bucket's flat layout."""
    return rank * plan.chunk, (rank + 1) * plan.chunk


def bucket_pieces(plan: BucketPlan, rank: int) -> list[Piece]:
    """The pieces of ``plan``'s segments that fall into ``rank``'s chunk, in layout order."""
    begin, end = chunk_range(plan, rank)
    pieces = []
    for seg in plan.segments:
        lo, hi = max(begin, seg.offset), min(end, seg.offset + seg.length)
        if hi > lo:
            pieces.append(Piece(seg.param, seg.start + lo - seg.offset, hi - lo, plan.index, lo - begin))
    return pieces


def rank_pieces(plans: Sequence[BucketPlan], rank: int) -> list[Piece]:
    """Every piece ``rank`` owns, bucket by bucket."""
    return [piece for plan in plans for piece in bucket_pieces(plan, rank)]


def shard_numel(plans: Sequence[BucketPlan]) -> int:
    """Elements one rank owns, padding included (the same on every rank)."""
    return sum(plan.chunk for plan in plans)
