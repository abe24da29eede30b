"""ASA's two halves apart: a reduce-scatter (Alltoall + local fp32 sum) and an Allgather.

ASA (:func:`~lightning_mpi.comm.collectives.asa_mean_steps`) averages a bucket in two stages: the
Alltoall and the local sum leave rank ``r`` with the mean of everybody's chunk ``r`` (a
reduce-scatter), and the Allgather shares the means. ZeRO runs them apart, with the optimizer step
in between: :func:`reduce_scatter_mean_steps` gives each rank the averaged gradient of its chunk,
the rank steps it, and :func:`allgather_steps` shares the updated weights (or their change). The
bytes on the wire are ASA's.

The buffers are not per bucket but come from a :class:`StagingPool` of a few slots, each sized for
the largest bucket, so the exchange needs a bounded amount of memory whatever the model size.
Every function here is an exchange generator for :class:`~lightning_mpi.comm.engine.ExchangeScheduler`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import Codec
from lightning_mpi.comm.collectives import _mean_of_rows_, _others
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport


@dataclass
class Staging:
    """Scratch for one bucket in flight: ``rows`` (the packed send rows, later the decoded ones),
    ``recv`` (fp32 Alltoall rows / gathered rows) and, for a lossy codec, the wire rows. Buffers
    are flat and sized for the largest bucket; :meth:`rows_for` etc. give contiguous views."""

    world: int
    rows: Tensor
    recv: Tensor
    send_wire: Tensor | None
    recv_wire: Tensor | None
    codec: Codec

    def rows_for(self, chunk: int) -> Tensor:
        return self.rows[: self.world * chunk].view(self.world, chunk)

    def recv_for(self, chunk: int) -> Tensor:
        return self.recv[: self.world * chunk].view(self.world, chunk)

    def wire_for(self, chunk: int) -> tuple[Tensor, Tensor]:
        assert self.send_wire is not None and self.recv_wire is not None
        width = self.codec.wire_numel(chunk)
        n = self.world * width
        return self.send_wire[:n].view(self.world, width), self.recv_wire[:n].view(self.world, width)


class StagingPool:
    """``count`` :class:`Staging` slots for buckets of up to ``max_chunk`` elements per rank.

    ``acquire()`` returns a free slot or ``None``; ``release(slot)`` gives it back. Slots are made on
    first use, so a pool that is never fully used never holds its whole size. Thread-safe: an
    exchange finishing on a progress thread releases its slot there.
    """

    def __init__(
        self, world: int, max_chunk: int, codec: Codec, count: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.world, self.max_chunk, self.codec, self.count = world, max_chunk, codec, count
        self.dtype, self.device = dtype, device
        self._free: list[Staging] = []
        self._made = 0
        self._lock = threading.Lock()

    def _make(self) -> Staging:
        n = self.world * self.max_chunk

        def new(numel: int, dtype: torch.dtype) -> Tensor:
            return torch.empty(numel, dtype=dtype, device=self.device)

        wire = None
        if self.codec.lossy:
            wire = self.world * self.codec.wire_numel(self.max_chunk)
        return Staging(
            self.world,
            new(n, self.dtype),
            new(n, self.dtype),
            new(wire, self.codec.wire_dtype) if wire else None,
            new(wire, self.codec.wire_dtype) if wire else None,
            self.codec,
        )

    def acquire(self) -> Staging | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made < self.count:
                self._made += 1
                return self._make()
            return None

    def release(self, slot: Staging) -> None:
        with self._lock:
            self._free.append(slot)

    def has_free(self) -> bool:
        with self._lock:
            return bool(self._free) or self._made < self.count

    def drop(self) -> None:
        """Forget the free slots (their memory goes back to the allocator); slots still out are
        dropped as they come back only if :meth:`drop` is called again."""
        with self._lock:
            self._made -= len(self._free)
            self._free.clear()


def reduce_scatter_mean_steps(
    transport: Transport, rows: Tensor, out: Tensor, codec: Codec, staging: Staging, accumulate: bool = False
) -> Exchange:
    """Mean over ranks of everybody's row ``rank`` of ``rows`` (``[W, c]``), into ``out`` (``[c]``).

    ``accumulate=True`` adds the mean to ``out`` instead (a second backward before the step). With
    a lossy codec each row sent to another rank is rounded once onto the wire; this rank's own row
    enters the fp32 sum exactly. Rows are summed in rank order, as ASA does, so the result is the
    bitwise value ASA leaves in that chunk. ``rows`` is overwritten.
    """
    world, rank = transport.size, transport.rank
    chunk = rows.shape[1]
    if world == 1:
        if accumulate:
            out.add_(rows[0])
        else:
            out.copy_(rows[0])
        return
    if not codec.lossy:
        summed = staging.recv_for(chunk)
        yield from transport.ialltoall(rows, summed)
    else:
        send_wire, recv_wire = staging.wire_for(chunk)
        for a, b in _others(world, rank):
            codec.encode(rows[a:b], send_wire[a:b])
        yield from transport.ialltoall(send_wire, recv_wire)
        for a, b in _others(world, rank):
            codec.decode(recv_wire[a:b], rows[a:b])
        summed = rows
    if accumulate:
        _mean_of_rows_(list(summed), summed[0])  # in place: row 0 is read before it is written
        out.add_(summed[0])
    else:
        _mean_of_rows_(list(summed), out)


def allgather_steps(transport: Transport, mine: Tensor, gathered: Tensor, codec: Codec, staging: Staging) -> Exchange:
    """Every rank's ``mine`` (``[1, c]`` float) into row ``rank`` of ``gathered`` (``[W, c]``).

    With a lossy codec every row, this rank's included, is the decoded wire value, so all ranks
    hold the same ``gathered``."""
    world = transport.size
    chunk = mine.shape[1]
    if world == 1:
        if codec.lossy:
            send_wire, _ = staging.wire_for(chunk)
            codec.encode(mine, send_wire[:1])
            codec.decode(send_wire[:1], gathered)
        else:
            gathered.copy_(mine)
        return
    if not codec.lossy:
        yield from transport.iallgather(mine, gathered)
        return
    send_wire, recv_wire = staging.wire_for(chunk)
    codec.encode(mine, send_wire[:1])
    yield from transport.iallgather(send_wire[:1], recv_wire)
    codec.decode(recv_wire, gathered)
