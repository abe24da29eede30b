"""One fragment of the model for DiLoCo's outer loop: whole parameter tensors that are synced together.

An :class:`OuterFragment` owns, for its tensors: the flat local weights (a padded view of the
parameters, :class:`~lightning_mpi.rules.easgd.FlatParams`), the global weights θ_global that
every rank holds identically, the pseudo-gradient buffer Δ that is averaged over ranks, and,
with a lossy wire, the error-feedback residuals. DiLoCo has one fragment holding every tensor;
Streaming DiLoCo has ``fragments`` of them, synced in turn.

The wire is a dense codec (:mod:`lightning_mpi.comm.codecs`: fp32 by one Allreduce, bf16, int8 or
int4 by ASA with error feedback) or SparseLoCo's
(:class:`~lightning_mpi.comm.sparseloco.SparseLoCoWire`: each tensor's chunks' largest entries with
2-bit values, one Allgather, and a decaying error-feedback accumulator in :attr:`OuterFragment.residual`
that runs at every world size, one rank included).

An exchange goes ``idle`` → ``running`` (started, non-blocking) → ``arrived`` (the mean Δ is
in :attr:`OuterFragment.delta`, identical on every rank) → ``idle`` once the outer step has used it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import Codec
from lightning_mpi.comm.collectives import ASAWorkspace, allreduce_mean_steps, asa_mean_steps
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.sparseloco import SparseLayout, SparseLoCoWire, SparseLoCoWorkspace, sparseloco_mean_steps
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.easgd import FlatParams

#: How Δ travels: a dense codec, or SparseLoCo's sparse wire.
Wire = Codec | SparseLoCoWire


def exchange_bytes(padded_numel: int, world_size: int, codec: Wire, sizes: Sequence[int] = ()) -> int:
    """Bytes one rank sends to average ``padded_numel`` values once (bandwidth-optimal algorithms).

    fp32 goes by one Allreduce (``2 (W-1)/W · n · 4``); a lossy wire by ASA: ``W - 1`` encoded
    chunks out in the Alltoall and ``W - 1`` copies of the owned chunk out in the Allgather;
    SparseLoCo's by one Allgather of its row (``W - 1`` rows out), sized by the tensors' ``sizes``
    (default: one tensor of ``padded_numel``)."""
    if world_size == 1:
        return 0
    if isinstance(codec, SparseLoCoWire):
        return codec.exchange_bytes(list(sizes) or [padded_numel], world_size)
    if not codec.lossy:
        return int(2 * (world_size - 1) / world_size * padded_numel * 4)
    chunk = padded_numel // world_size
    words = codec.wire_numel(chunk) * torch.empty((), dtype=codec.wire_dtype).element_size()
    return 2 * (world_size - 1) * words


class OuterFragment:
    """Local and global weights, Δ and feedback buffers of one group of whole tensors.

    Args:
        params: the fragment's parameters (one dtype, one device), in model order.
        world_size: the number of ranks (buffers are padded to a multiple of it).
        codec: the wire of Δ; a lossy dense one gets error feedback, SparseLoCo's its accumulator.
        error_decay: β of SparseLoCo's accumulator, ``e ← β·e + Δ`` (its wire only).
    """

    def __init__(self, params: Sequence[Tensor], world_size: int, codec: Wire, error_decay: float = 1.0) -> None:
        self.local = FlatParams(params, world_size)
        self.numel = self.local.bucket.numel
        self.world_size = world_size
        self.codec = codec
        self.error_decay = error_decay
        self.theta_global = self.local.pull().clone()
        self.delta = torch.zeros_like(self.theta_global)
        bucket = self.local.bucket
        sizes = [t.numel() for t in bucket.tensors]
        self._sparse: SparseLoCoWorkspace | None = None
        self._work: ASAWorkspace | None = None
        self.residual: Tensor | None = None
        self.owner_residual: Tensor | None = None
        if isinstance(codec, SparseLoCoWire):  # its accumulator runs on one rank too (module docstring)
            layout = SparseLayout(codec, list(zip(bucket.offsets, sizes, strict=True)), self.delta.device)
            self._sparse = SparseLoCoWorkspace(layout, world_size, self.delta.device)
            self.residual = torch.zeros_like(self.delta)
        else:
            lossy = codec.lossy and world_size > 1
            self.residual = torch.zeros_like(self.delta) if lossy else None
            self.owner_residual = self.delta.new_zeros(self.delta.numel() // world_size) if lossy else None
            self._work = ASAWorkspace.for_buffer(self.delta, world_size, codec) if lossy else None
        self.status = "idle"
        self.due = 0  # the step at which the running or arrived exchange is applied
        self.started = 0  # the step at which the last exchange started
        self.bytes_per_exchange = exchange_bytes(self.delta.numel(), world_size, codec, sizes)

    def adopt_local(self) -> None:
        """θ_global ← the current local weights (at train start, when every rank holds the same)."""
        self.theta_global.copy_(self.local.pull())

    def mean_steps(self, team: Transport) -> Exchange:
        """Average :attr:`delta` over ``team`` (fp32: one Iallreduce; lossy: ASA with feedback;
        SparseLoCo's: one Iallgather of the rows, with its accumulator)."""
        codec = self.codec
        if isinstance(codec, SparseLoCoWire):
            if self._sparse is not None and self.residual is not None:
                yield from sparseloco_mean_steps(team, self.delta, self._sparse, self.residual, self.error_decay)
            return  # every entry outside the tensors stays zero: rows land only inside them
        if team.size == 1:
            return
        if self._work is None:
            yield from allreduce_mean_steps(team, self.delta)
            return
        yield from asa_mean_steps(team, self.delta, codec, self._work, self.residual, self.owner_residual)
        # Padding must stay zero (it is neither a weight nor a residual).
        self.delta[self.numel :].zero_()
        if self.residual is not None:
            self.residual[self.numel :].zero_()
        if self.owner_residual is not None:
            chunk = self.owner_residual.numel()
            self.owner_residual[min(chunk, max(0, self.numel - team.rank * chunk)) :].zero_()
