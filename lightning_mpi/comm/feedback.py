"""Error feedback for lossy row codecs, and ASA with it (Seide et al. 2014; Karimireddy et al. 2019).

What a lossy codec does not send is kept in a residual and added to the next step's input::

    a = g + r;   wire = encode(a);   r = a - decode(wire)

so that, summed over steps, what was sent plus the residual equals what was given. With
:class:`~lightning_mpi.comm.codecs.Int8Codec` every operation above is exact (power-of-two grid),
so the bookkeeping is exact to the last bit; with the other codecs it is exact up to the fp32
rounding of ``a - decode(wire)``.

:func:`ef_asa_mean_steps` is ASA (Alltoall → fp32 sum → Allgather) with feedback on both lossy
stages: each rank keeps the residual of the rows it sends, and the owner of chunk ``j`` keeps the
residual of re-encoding the mean of chunk ``j`` for the Allgather. A rank's own row never crosses
a wire and enters its sum exactly.

The hot path allocates nothing large: codecs write into the workspace's wire and scratch
buffers, residuals are updated in place, and the sum is a chain of in-place row adds.
"""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import Codec
from lightning_mpi.comm.collectives import ASAWorkspace
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport


def encode_with_feedback_(codec: Codec, rows: Tensor, wire: Tensor, residual: Tensor | None, scratch: Tensor) -> None:
    """Encode ``rows + residual`` into ``wire``; leave what the wire misses in ``residual``.

    ``rows`` (``[r, c]``) is overwritten with ``rows + residual``; ``scratch`` is ``[r, c]`` float
    scratch and holds the decoded wire afterwards. ``residual=None`` encodes ``rows`` as is (no
    feedback).
    """
    if residual is not None:
        rows.add_(residual)
    codec.encode(rows, wire)
    if residual is not None:
        codec.decode(wire, scratch)
        torch.sub(rows, scratch, out=residual)


def _others(world: int, rank: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of every rank but ``rank`` (one or two contiguous blocks)."""
    return [(a, b) for a, b in ((0, rank), (rank + 1, world)) if b > a]


def ef_asa_mean_steps(
    transport: Transport,
    flat: Tensor,
    codec: Codec,
    work: ASAWorkspace,
    residual: Tensor | None = None,
    owner_residual: Tensor | None = None,
) -> Exchange:
    """Mean over ranks by ASA with ``codec`` on the wire and error feedback.

    ``residual`` is shaped like ``flat`` (this rank's unsent part of every chunk);
    ``owner_residual`` like one chunk (``flat.numel() // world``: the unsent part of the mean of
    the chunk this rank owns). Either may be ``None`` (no feedback on that stage).

    A rank's own chunk never crosses a wire, so it is neither encoded nor decoded: it enters the
    sum exactly (and its residual is cleared), which saves ``1/world`` of the Alltoall stage's codec
    work and loses nothing. The Alltoall still carries a (stale) self row; MPI copies it locally.
    """
    world, rank = transport.size, transport.rank
    rows = flat.view(world, -1)
    others = _others(world, rank)
    res = None if residual is None else residual.view(world, -1)
    if res is not None:
        rows[rank].add_(res[rank])
        res[rank].zero_()  # sent exactly (non-zero only after a restore from another world size)
    for a, b in others:
        encode_with_feedback_(codec, rows[a:b], work.send_wire[a:b], None if res is None else res[a:b], work.decoded[a:b])
    yield from transport.ialltoall(work.send_wire, work.recv_wire)
    for a, b in others:
        codec.decode(work.recv_wire[a:b], work.decoded[a:b])
    # Sum in fp32 in rank order (row adds: torch.sum over a short dim 0 is several times slower),
    # then one rounding onto the wire for the Allgather.
    parts = [rows[j] if j == rank else work.decoded[j] for j in range(world)]
    mine = work.mine[0]
    torch.add(parts[0], parts[1], out=mine)
    for part in parts[2:]:
        mine.add_(part)
    mine.div_(world)
    own = None if owner_residual is None else owner_residual.view(1, -1)
    encode_with_feedback_(codec, work.mine, work.mine_wire, own, work.decoded[:1])
    yield from transport.iallgather(work.mine_wire, work.recv_wire)
    for a, b in others:
        codec.decode(work.recv_wire[a:b], rows[a:b])
    if own is not None:  # the feedback step already decoded this rank's gathered row
        rows[rank].copy_(work.decoded[0])
    else:
        codec.decode(work.recv_wire[rank : rank + 1], rows[rank : rank + 1])
