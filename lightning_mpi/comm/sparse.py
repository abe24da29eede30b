"""Top-k sparsification: each rank sends its ``k`` largest-magnitude entries as (index, value) pairs.

Top-k does not fit ASA: ranks choose different indices, so there is no chunk to own. Every rank
sends a fixed ``k`` (sizes are known in advance), one ``Allgather`` of ``2k`` 32-bit words per rank
(``int32`` indices, then the ``float32`` values as raw words) brings every rank all pairs, and a
local scatter-add in rank order builds the same sum everywhere (Aji & Heafield 2017; Lin et al.'s
Deep Gradient Compression 2018).

With error feedback the unsent entries stay in a residual and join the next step's gradient.
With DGC's momentum correction the momentum is accumulated locally before selection
(``u = m·u + g; v = v + u``), ``v`` is what is selected from, and both ``u`` and ``v`` are cleared
where entries were sent (momentum factor masking).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport


def check_ratio(ratio: float, name: str = "ratio") -> float:
    """``ratio`` must be a real number in (0, 1]; raise ``ValueError`` naming ``name`` otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"{name}={ratio!r} is out of range: it must be a number in (0, 1]")
    return float(ratio)


def topk_count(numel: int, ratio: float) -> int:
    """How many entries of ``numel`` a rank sends at ``ratio`` (at least one, at most all)."""
    return max(1, min(numel, math.ceil(ratio * numel - 1e-9))) if numel else 0


def topk_select(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest-magnitude entries of the 1-D ``values`` (unordered)."""
    if k >= values.numel():
        return torch.arange(values.numel(), device=values.device)
    return torch.topk(values.abs(), k, sorted=False).indices


@dataclass(frozen=True)
class TopKCodec:
    """Stateless (index, value) wire format for one tensor (Horovod-style ``compress``/``decompress``).

    The wire is ``int32[2k]``: ``k`` indices, then the ``k`` float32 values as raw words. Usable
    wherever a whole tensor is sent at once (parameter-server commits).
    """

    ratio: float = 0.01
    name: str = "topk"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)

    def wire_numel(self, numel: int) -> int:
        return 2 * topk_count(numel, self.ratio)

    def compress(self, tensor: Tensor) -> tuple[Tensor, tuple]:
        flat = tensor.detach().reshape(-1).float()
        k = topk_count(flat.numel(), self.ratio)
        wire = torch.empty(2 * k, dtype=torch.int32, device=flat.device)
        pack_pairs(flat, topk_select(flat, k), wire)
        return wire, (tensor.shape, tensor.dtype)

    def decompress(self, wire: Tensor, ctx: tuple) -> Tensor:
        shape, dtype = ctx
        out = torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float32, device=wire.device)
        scatter_pairs_(out, wire)
        return out.reshape(shape).to(dtype)


def pack_pairs(values: Tensor, index: Tensor, wire: Tensor) -> None:
    """Write ``index`` and ``values[index]`` into the ``int32[2k]`` ``wire``."""
    k = index.numel()
    wire[:k].copy_(index)
    wire[k:].view(torch.float32).copy_(values[index])


def scatter_pairs_(out: Tensor, wire: Tensor) -> None:
    """``out[index] += value`` for the pairs in one ``int32[2k]`` wire row."""
    k = wire.numel() // 2
    out.index_add_(0, wire[:k].long(), wire[k:].view(torch.float32))


class TopKWorkspace:
    """Send row ``[1, 2k]`` and gathered rows ``[world, 2k]``, reused while ``k`` stays the same."""

    def __init__(self, k: int, world: int, device: torch.device) -> None:
        self.k = k
        self.send = torch.empty(1, 2 * k, dtype=torch.int32, device=device)
        self.recv = torch.empty(world, 2 * k, dtype=torch.int32, device=device)


def topk_mean_steps(
    transport: Transport,
    flat: Tensor,
    k: int,
    work: TopKWorkspace,
    residual: Tensor | None = None,
    momentum_buf: Tensor | None = None,
    momentum: float = 0.0,
) -> Exchange:
    """Mean over ranks of every rank's top-``k`` entries, left dense in ``flat`` on every rank.

    ``k`` counts entries of ``flat[:numel]`` for the caller's ``numel``; ``residual`` (error
    feedback) and ``momentum_buf`` (momentum correction) are shaped like ``flat`` or ``None``.
    """
    world = transport.size
    source = flat
    if momentum_buf is not None:
        momentum_buf.mul_(momentum).add_(flat)  # u = m·u + g
        source = momentum_buf
    if residual is not None:
        residual.add_(source)  # v = v + (u or g)
        source = residual
    index = topk_select(source, k)
    pack_pairs(source, index, work.send[0])
    if residual is not None:
        residual[index] = 0
    if momentum_buf is not None:
        momentum_buf[index] = 0
    yield from transport.iallgather(work.send, work.recv)
    flat.zero_()
    for row in work.recv:  # rank order: the same sum on every rank
        scatter_pairs_(flat, row)
    flat.div_(world)
