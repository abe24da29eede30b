"""Averaging exchanges built on :class:`~lightning_mpi.comm.transport.Transport`.

Each function leaves the mean over all ranks in ``flat`` on every rank, bitwise identical across
ranks. ``flat`` is one padded bucket buffer (length a multiple of the world size).

- :func:`allreduce_mean_`: one ``MPI_Allreduce``.
- :func:`asa_mean_`: Theano-MPI's Alltoall-sum-Allgather. Rank ``j`` receives everybody's chunk
  ``j``, sums it in fp32, and the sums are allgathered. With a 16-bit codec each rank's chunk is
  rounded once onto the wire, the fp32 sum of all ranks' chunks is rounded once for the
  allgather, and every rank decodes the same gathered words, so replicas stay identical.

Scratch buffers live in an :class:`ASAWorkspace` that is created once per bucket and reused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import FP32, Codec
from lightning_mpi.comm.transport import Transport


def allreduce_mean_(transport: Transport, flat: Tensor) -> Tensor:
    """Average ``flat`` over ranks in place with one Allreduce."""
    if transport.size > 1:
        transport.allreduce_(flat, "sum")
        flat.div_(transport.size)
    return flat


@dataclass
class ASAWorkspace:
    """Reusable scratch for one bucket: wire rows out and in, decoded rows, the local sum."""

    send_wire: Tensor  # [W, wire(c)]   this rank's encoded chunks, row j for rank j
    recv_wire: Tensor  # [W, wire(c)]   chunk `rank` from every rank, later the gathered sums
    decoded: Tensor  # [W, c] fp32    received rows decoded
    mine: Tensor  # [1, c] fp32    the reduced chunk this rank owns
    mine_wire: Tensor  # [1, wire(c)]

    @classmethod
    def for_buffer(cls, flat: Tensor, world_size: int, codec: Codec) -> "ASAWorkspace":
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


def asa_mean_(transport: Transport, flat: Tensor, codec: Codec = FP32, work: ASAWorkspace | None = None) -> Tensor:
    """Average ``flat`` over ranks in place by Alltoall → fp32 sum → Allgather.

    With the fp32 codec the received chunks are summed straight from the receive buffer and the
    sums are gathered straight into ``flat``; with a 16-bit codec they go through the wire
    buffers of ``work`` (allocated here if not given; pass one to keep the hot path allocation-free).
    """
    world = transport.size
    if world == 1:
        return flat
    if work is None:
        work = ASAWorkspace.for_buffer(flat, world, codec)
    rows = flat.view(world, -1)
    if codec is FP32 or codec.wire_dtype == flat.dtype and not codec.lossy:
        transport.alltoall(rows, work.decoded)
        torch.sum(work.decoded, dim=0, keepdim=True, out=work.mine)
        work.mine.div_(world)
        transport.allgather(work.mine, rows)
        return flat
    codec.encode(rows, work.send_wire)
    transport.alltoall(work.send_wire, work.recv_wire)
    codec.decode(work.recv_wire, work.decoded)
    torch.sum(work.decoded, dim=0, keepdim=True, out=work.mine)
    work.mine.div_(world)
    codec.encode(work.mine, work.mine_wire)
    transport.allgather(work.mine_wire, work.recv_wire)
    codec.decode(work.recv_wire, rows)
    return flat
