"""Averaging exchanges built on :class:`~lightning_mpi.comm.transport.Transport`.

Each exchange leaves the mean over all ranks in ``flat`` on every rank, bitwise identical across
ranks. ``flat`` is one padded bucket buffer (length a multiple of the world size).

- :func:`allreduce_mean_` (blocking) and :func:`allreduce_mean_steps`: one ``MPI_Allreduce``.
- :func:`asa_mean_steps`: Theano-MPI's Alltoall-sum-Allgather, for every wire format (fp32,
  fp16, bf16, int8, 1-bit), with or without error feedback. Rank ``j`` receives everybody's
  chunk ``j``, sums it in fp32, and the sums are allgathered.
- :func:`hierarchical_mean_steps`: within the node, across node leaders, within the node again.

The ``*_steps`` exchanges are generators that ``yield`` an MPI request wherever they must wait
(see :mod:`lightning_mpi.comm.engine`, which drives many of them at once). Scratch buffers live
in an :class:`ASAWorkspace` that is created once per bucket (or segment) and reused.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what a lossy codec does not send is
kept in a residual and added to the next step's input::

    a = g + r;   wire = encode(a);   r = a - decode(wire)

so that, summed over steps, what was sent plus the residual equals what was given. With
:class:`~lightning_mpi.comm.codecs.Int8Codec` every operation above is exact (power-of-two grid),
so the bookkeeping is exact to the last bit; with the other codecs it is exact up to the fp32
rounding of ``a - decode(wire)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import Codec, Int8Codec, cuda_kernels
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport


def allreduce_mean_(transport: Transport, flat: Tensor) -> Tensor:
    """Average ``flat`` over ranks in place with one Allreduce (blocking, with the transport's timeout)."""
    if transport.size > 1:
        transport.allreduce_(flat, "sum")
        flat.div_(transport.size)
    return flat


def allreduce_mean_steps(transport: Transport, flat: Tensor) -> Exchange:
    """Mean over ranks by one ``Iallreduce``."""
    yield from transport.iallreduce_(flat)
    flat.div_(transport.size)


@dataclass
class ASAWorkspace:
    """Reusable scratch for one bucket: wire rows out and in, decoded rows, the local sum."""

    send_wire: Tensor  # [W, wire(c)]   this rank's encoded chunks, row j for rank j
    recv_wire: Tensor  # [W, wire(c)]   chunk `rank` from every rank, later the gathered sums
    decoded: Tensor  # [W, c] fp32    received rows decoded
    mine: Tensor  # [1, c] fp32    the reduced chunk this rank owns
    mine_wire: Tensor  # [1, wire(c)]

    @classmethod
    def for_buffer(cls, flat: Tensor, world_size: int, codec: Codec) -> ASAWorkspace:
        if flat.numel() % world_size:
            raise ValueError(f"buffer of {flat.numel()} elements is not padded to a multiple of {world_size}")
        chunk = flat.numel() // world_size
        wire = codec.wire_numel(chunk)
        acc = flat.dtype

        def new(rows: int, cols: int, dtype: torch.dtype) -> Tensor:
            return torch.empty(rows, cols, dtype=dtype, device=flat.device)

        return cls(
            send_wire=new(world_size, wire, codec.wire_dtype),
            recv_wire=new(world_size, wire, codec.wire_dtype),
            decoded=new(world_size, chunk, acc),
            mine=new(1, chunk, acc),
            mine_wire=new(1, wire, codec.wire_dtype),
        )


def encode_with_feedback_(codec: Codec, rows: Tensor, wire: Tensor, residual: Tensor | None, scratch: Tensor) -> None:
    """Encode ``rows + residual`` into ``wire``; leave what the wire misses in ``residual``.

    ``rows`` (``[r, c]``) is overwritten with ``rows + residual``; ``scratch`` is ``[r, c]`` float
    scratch and holds the decoded wire afterwards. ``residual=None`` encodes ``rows`` as is (no
    feedback). On CUDA with cupy, int8 runs all of it as two fused kernels (bit-exact; see
    :mod:`lightning_mpi.comm.cupy_kernels`).
    """
    if residual is not None and rows.is_cuda and type(codec) is Int8Codec:
        kernels = cuda_kernels(rows)
        if kernels is not None and kernels.int8_encode(codec, rows, wire, residual, scratch):
            return
    if residual is None:
        codec.encode(rows, wire)
        return
    rows.add_(residual)
    codec.encode_decoded(rows, wire, scratch)
    torch.sub(rows, scratch, out=residual)


def _others(world: int, rank: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of every rank but ``rank`` (one or two contiguous blocks)."""
    return [(a, b) for a, b in ((0, rank), (rank + 1, world)) if b > a]


def _mean_of_rows_(rows: list[Tensor], out: Tensor) -> None:
    """``out = mean(rows)``, summed in fp32 in rank order by row adds (``torch.sum`` over a short
    leading dimension measured several times slower), so every owner sums the same way."""
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)
    out.div_(len(rows))


def asa_mean_steps(
    transport: Transport,
    flat: Tensor,
    codec: Codec,
    work: ASAWorkspace,
    residual: Tensor | None = None,
    owner_residual: Tensor | None = None,
) -> Exchange:
    """Mean over ranks by ``Ialltoall`` → fp32 sum → ``Iallgather`` with ``codec`` on the wire.

    ``residual`` is shaped like ``flat`` (this rank's unsent part of every chunk);
    ``owner_residual`` like one chunk (``flat.numel() // world``: the unsent part of the mean of
    the chunk this rank owns). Either may be ``None`` (no feedback on that stage).

    A lossless codec without feedback (fp32) sends ``flat``'s rows as they are and gathers the
    means straight into ``flat``. Otherwise each chunk sent to another rank is rounded once onto
    the wire, the fp32 mean of every rank's chunk is rounded once for the Allgather, and every
    rank decodes the same gathered words, so replicas stay identical. A rank's own chunk never
    crosses a wire, so it is neither encoded nor decoded: it enters the sum exactly (and its
    residual is cleared), which saves ``1/world`` of the Alltoall stage's codec work and loses
    nothing. The Alltoall still carries a (stale) self row; MPI copies it locally.
    """
    world, rank = transport.size, transport.rank
    rows = flat.view(world, -1)
    if world == 1:
        return
    if not codec.lossy and residual is None and owner_residual is None:
        yield from transport.ialltoall(rows, work.decoded)
        _mean_of_rows_(list(work.decoded), work.mine[0])
        yield from transport.iallgather(work.mine, rows)
        return
    others = _others(world, rank)
    res = None if residual is None else residual.view(world, -1)
    if res is not None:
        rows[rank].add_(res[rank])
        res[rank].zero_()  # sent exactly (non-zero only after a restore from another world size)
    for a, b in others:
        encode_with_feedback_(
            codec, rows[a:b], work.send_wire[a:b], None if res is None else res[a:b], work.decoded[a:b]
        )
    yield from transport.ialltoall(work.send_wire, work.recv_wire)
    for a, b in others:
        codec.decode(work.recv_wire[a:b], work.decoded[a:b])
    _mean_of_rows_([rows[j] if j == rank else work.decoded[j] for j in range(world)], work.mine[0])
    own = None if owner_residual is None else owner_residual.view(1, -1)
    encode_with_feedback_(codec, work.mine, work.mine_wire, own, work.decoded[:1])
    yield from transport.iallgather(work.mine_wire, work.recv_wire)
    for a, b in others:
        codec.decode(work.recv_wire[a:b], rows[a:b])
    if own is not None:  # the feedback step already decoded this rank's gathered row
        rows[rank].copy_(work.decoded[0])
    else:
        codec.decode(work.recv_wire[rank : rank + 1], rows[rank : rank + 1])


def hierarchical_mean_steps(
    local: Transport, leaders: Transport | None, flat: Tensor, world_size: int, leader_exchange
) -> Exchange:
    """Topology-aware mean (PowerAI DDL): sum within the node over shared memory onto the node
    leader, average among node leaders across the link, share the result within the node.

    ``leaders`` is the communicator of local rank 0 of every node (``None`` on other ranks);
    ``leader_exchange(transport, flat)`` is the exchange generator the leaders use (Allreduce or
    ASA with any codec): it averages over leaders, so the sum of node sums is that times the
    number of leaders, and dividing by ``world_size`` gives the mean over all ranks.
    """
    if local.size > 1:
        yield from local.ireduce_(flat, root=0)
    if leaders is not None:
        if leaders.size > 1:
            yield from leader_exchange(leaders, flat)
            flat.mul_(leaders.size / world_size)
        else:
            flat.div_(world_size)
    if local.size > 1:
        yield from local.ibroadcast_(flat, root=0)


def segments(flat: Tensor, world_size: int, segment_numel: int) -> list[Tensor]:
    """Cut a padded buffer into views whose lengths are multiples of ``world_size``."""
    step = max(world_size, (segment_numel // world_size) * world_size)
    return [flat[i : i + step] for i in range(0, flat.numel(), step)]
