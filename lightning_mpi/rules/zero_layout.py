"""Where each rank's shard lies: buckets over the parameters, and the pieces of them a rank owns.

ZeRO on ASA (:mod:`lightning_mpi.rules.zero`) cuts the trainable parameters into buckets, each a
flat run of whole parameters padded to a multiple of the world size ``W``. ASA's Alltoall and
local sum reduce a bucket so that rank ``r`` ends up with the summed gradient of the ``r``-th of its
``W`` equal chunks: ``[r·c, (r+1)·c)`` with ``c = padded / W``. A rank's shard is its chunk of every
bucket. Inside a chunk, the parameters that overlap it give :class:`Piece`\\ s: the element range
``[start, start + length)`` of one flattened parameter, placed at ``offset`` in the chunk. Each piece
becomes one tensor of the sharded optimizer.

Everything here is integer arithmetic on (numel, dtype, device) descriptions of the parameters, so
the partition can be worked out for any world size without tensors or MPI (resharding a checkpoint
compares the layouts of two world sizes). Buckets follow
:func:`~lightning_mpi.comm.buffers.make_buckets`' rule (reverse registration order, grouped by
device and exchange dtype, a bucket closed once it holds ``bucket_bytes``), without allocating
their buffers: ZeRO keeps no full-size bucket buffer.
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

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "ParamSpec":
        return cls(tensor.numel(), tensor.dtype, tensor.device)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: ``members`` (indices into the parameter list) laid out at ``offsets``.

    ``numel`` real elements, padded to ``chunk * world`` so that every rank owns ``chunk`` of them.
    ``dtype`` is the exchange (and summation) dtype: float64 for float64 parameters, else float32.
    """

    index: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    chunk: int
    dtype: torch.dtype
    device: torch.device

    world: int

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
    """Group parameters into buckets as :func:`~lightning_mpi.comm.buffers.make_buckets` does.

    Reverse registration order (backward produces gradients roughly last layer first, so the
    first bucket is ready first), one run of buckets per (device, exchange dtype), a bucket closed
    once it holds ``bucket_bytes`` or more (``None``: one bucket per group). Parameters with no
    elements are left out: they own nothing and exchange nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    if bucket_bytes is not None and bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be >= 1 or None")
    groups: dict[tuple[torch.device, torch.dtype], list[list[int]]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    for index in reversed(range(len(specs))):
        spec = specs[index]
        if spec.numel == 0:
            continue
        key = (spec.device, buffer_dtype(spec.dtype))
        runs = groups.setdefault(key, [])
        if key not in open_bytes:
            runs.append([])
            open_bytes[key] = 0
        runs[-1].append(index)
        open_bytes[key] += spec.numel * torch.empty((), dtype=key[1]).element_size()
        if bucket_bytes is not None and open_bytes[key] >= bucket_bytes:
            del open_bytes[key]
    plans: list[BucketPlan] = []
    for (device, dtype), runs in groups.items():
        for members in runs:
            offsets, total = [], 0
            for index in members:
                offsets.append(total)
                total += specs[index].numel
            chunk = padded_numel(total, world_size) // world_size
            plans.append(BucketPlan(len(plans), tuple(members), tuple(offsets), total, chunk, dtype, device, world_size))
    return plans


def chunk_range(plan: BucketPlan, rank: int) -> tuple[int, int]:
    """``[begin, end)`` of ``rank``'s chunk inside the bucket's flat layout."""
    return rank * plan.chunk, (rank + 1) * plan.chunk


def bucket_pieces(plan: BucketPlan, specs: Sequence[ParamSpec], rank: int) -> list[Piece]:
    """The pieces of ``plan``'s members that fall into ``rank``'s chunk, in layout order."""
    begin, end = chunk_range(plan, rank)
    pieces = []
    for member, offset in zip(plan.members, plan.offsets):
        lo, hi = max(begin, offset), min(end, offset + specs[member].numel)
        if hi > lo:
            pieces.append(Piece(member, lo - offset, hi - lo, plan.index, lo - begin))
    return pieces


def rank_pieces(plans: Sequence[BucketPlan], specs: Sequence[ParamSpec], rank: int) -> list[Piece]:
    """Every piece ``rank`` owns, bucket by bucket."""
    return [piece for plan in plans for piece in bucket_pieces(plan, specs, rank)]


def shard_numel(plans: Sequence[BucketPlan]) -> int:
    """Elements one rank owns, padding included (the same on every rank)."""
    return sum(plan.chunk for plan in plans)
