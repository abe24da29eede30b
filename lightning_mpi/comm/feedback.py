"""Error feedback for lossy row codecs, and ASA with it (Seide et al. 2014; Karimireddy et al. 2019).

What a lossy codec does not send is kept in a residual and added to the next step's input::

    a = g + r;   wire = encode(a);   r = a - decode(wire)

so that, summed over steps, what was sent plus the residual equals what was given. With
:class:`~lightning_mpi.comm.codecs.Int8Codec` every operation above is exact (power-of-two grid),
so the bookkeeping is exact to the last bit; with the other codecs it is exact up to the fp32
rounding of ``a - decode(wire)``.

:func:`ef_asa_mean_steps` is ASA (Alltoall → fp32 sum → Allgather) with feedback on both lossy
stages: each rank keeps the residual of the rows it sends, and the owner of chunk ``j`` keeps the
residual of re-encoding the mean of chunk ``j`` for the Allgather.
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
    scratch. ``residual=None`` encodes ``rows`` as is (no feedback).
    """
    if residual is not None:
        rows.add_(residual)
    codec.encode(rows, wire)
    if residual is not None:
        codec.decode(wire, scratch)
        residual.copy_(rows).sub_(scratch)


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
    """
    world = transport.size
    rows = flat.view(world, -1)
    encode_with_feedback_(codec, rows, work.send_wire, None if residual is None else residual.view(world, -1), work.decoded)
    yield from transport.ialltoall(work.send_wire, work.recv_wire)
    codec.decode(work.recv_wire, work.decoded)
    # Sum in fp32, then one rounding onto the wire for the Allgather.
    torch.sum(work.decoded, dim=0, keepdim=True, out=work.mine)
    work.mine.div_(world)
    encode_with_feedback_(
        codec, work.mine, work.mine_wire, None if owner_residual is None else owner_residual.view(1, -1), work.decoded[:1]
    )
    yield from transport.iallgather(work.mine_wire, work.recv_wire)
    codec.decode(work.recv_wire, rows)
