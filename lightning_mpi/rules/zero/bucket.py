"""One ZeRO bucket: its members, this rank's gradient chunk and pieces, and its two exchanges.

A :class:`ShardBucket` owns no full-size buffer. Its exchanges borrow a
:class:`~lightning_mpi.comm.shard_exchange.Staging` slot while in flight:

- :meth:`ShardBucket.reduce_steps` packs the members' gradients into the slot, frees them (ZeRO
  stage 2: from here on this rank keeps gradient memory only for its chunk, in :attr:`grad`), and
  reduce-scatters: :attr:`grad` receives the mean over ranks of this rank's chunk;
- :meth:`ShardBucket.gather_steps` shares the stepped weights of every rank's chunk and writes them
  into the members.

The optimizer steps :attr:`piece_tensors`, 1-D tensors over this rank's pieces, whose gradients are
views of :attr:`grad`. Where it can, a piece is a view of the parameter itself (**direct**): the
optimizer updates the weights in place and no copy of them is kept. A bucket keeps an fp32
**master** copy of its chunk instead when the wire is lossy (the members receive the master's change
through the codec; the master keeps what the wire rounds off, and sends it with the next change),
when a member's dtype differs from the exchange dtype (bf16 weights: the master is the fp32 copy
that mixed-precision training needs) or when a member is not contiguous (no flat view of it exists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.codecs import FP32, Codec
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.shard_exchange import Staging, allgather_steps, reduce_scatter_mean_steps
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.zero.layout import BucketPlan, bucket_pieces


def needs_master(members: Sequence[Tensor], dtype: torch.dtype, codec: Codec) -> bool:
    """Whether a bucket must keep fp32 master weights for its chunk (see the module docstring)."""
    return codec.lossy or any(p.dtype != dtype or not p.is_contiguous() for p in members)


class ShardBucket:
    """Bucket ``plan`` of ``params`` on ``rank``, exchanged over ``team`` with ``codec`` on the wire."""

    def __init__(
        self,
        plan: BucketPlan,
        params: Sequence[Tensor],
        rank: int,
        team: Transport,
        codec: Codec,
        last_segment: set[tuple[int, int]],
        taken: dict[int, Tensor],
    ) -> None:
        self.plan = plan
        #: gradients of cut parameters whose first segments are packed, shared by the buckets
        self._taken = taken
        self.members = [params[i] for i in plan.members]
        self.team = team
        self.codec = codec
        self.pieces = bucket_pieces(plan, rank)
        # (tensor, segment, whether the parameter's gradient may be freed once this segment is packed)
        self._segments = [(params[seg.param], seg, (plan.index, seg.param) in last_segment) for seg in plan.segments]
        self._param = {index: params[index] for index in plan.members}
        self.grad = torch.zeros(plan.chunk, dtype=plan.dtype, device=plan.device)
        self.master: Tensor | None = None
        if needs_master(self.members, plan.dtype, codec):
            self.master = torch.zeros(plan.chunk, dtype=plan.dtype, device=plan.device)
            self.master_from_params()
            self.piece_tensors = [self.master[p.offset : p.offset + p.length] for p in self.pieces]
        else:
            self.piece_tensors = [params[p.param].detach().view(-1)[p.start : p.start + p.length] for p in self.pieces]
        self.piece_grads = [self.grad[p.offset : p.offset + p.length] for p in self.pieces]
        self._storage = [p.data_ptr() for p in self.members]
        # gradient hooks' bookkeeping for the current step: members that reported, launched yet
        self.ready = 0
        self.launched = False

    # -- weights ---------------------------------------------------------------------------------
    def own_values(self, out: Tensor) -> None:
        """Write this rank's chunk of the members' current values into ``out`` (``[chunk]``)."""
        end = 0
        for piece in self.pieces:
            param = self._param[piece.param]
            out[piece.offset : piece.offset + piece.length].copy_(
                param.detach().reshape(-1)[piece.start : piece.start + piece.length]
            )
            end = piece.offset + piece.length
        out[end:].zero_()

    def master_from_params(self) -> None:
        """Set the master weights to the members' values (after weights were loaded or changed)."""
        if self.master is not None:
            self.own_values(self.master)

    def storage_moved(self) -> bool:
        """True when a member's storage was replaced since the pieces were cut (``module.to``...)."""
        return [p.data_ptr() for p in self.members] != self._storage

    # -- exchanges -------------------------------------------------------------------------------
    def pack_grads(self, flat: Tensor) -> None:
        """Copy the members' gradients into ``flat`` (padded layout; a missing one gives zeros) and
        free them: the reduced chunk is all this rank keeps.

        A parameter cut over several buckets gives up its gradient when its first segment is packed:
        the tensor is kept aside for the other segments (no copy), and ``.grad`` is ``None`` again,
        so that what a further backward adds before the step starts from zero and is exchanged in
        a second pass, never twice."""
        for param, seg, last in self._segments:
            view = flat[seg.offset : seg.offset + seg.length]
            grad = self._taken.pop(seg.param, None) if last else self._taken.get(seg.param)
            if grad is None:
                grad, param.grad = param.grad, None
                if grad is not None and not last:
                    self._taken[seg.param] = grad
            if grad is None:
                view.zero_()
            elif seg.length == param.numel():
                view.view(param.shape).copy_(grad)  # whole: any memory layout
            else:
                view.copy_(grad.reshape(-1)[seg.start : seg.start + seg.length])
        flat[self.plan.numel :].zero_()

    def reduce_steps(self, staging: Staging, accumulate: bool, on_done: Callable[[Staging], None]) -> Exchange:
        """Pack, free and reduce-scatter this bucket's gradients into :attr:`grad`."""
        rows = staging.rows_for(self.plan.chunk)
        self.pack_grads(rows.view(-1))
        try:
            yield from reduce_scatter_mean_steps(self.team, rows, self.grad, self.codec, staging, accumulate)
        finally:
            on_done(staging)

    def gather_steps(self, staging: Staging, on_done: Callable[[Staging], None], exact: bool = False) -> Exchange:
        """Share every rank's stepped chunk and write the result into the members.

        Lossless: the weights themselves travel. Lossy: the change ``master - current`` travels and
        every rank (the owner too) adds the same decoded change, so replicas stay identical while
        the master keeps full precision. ``exact=True`` sends the master in fp32 whatever the wire
        (the end of training: the members take the master's exact values)."""
        chunk = self.plan.chunk
        mine = staging.rows_for(chunk)[:1]
        gathered = staging.recv_for(chunk)
        codec = self.codec
        delta = codec.lossy and not exact
        try:
            if delta:
                assert self.master is not None  # a lossy wire keeps fp32 master weights (see __init__)
                self.own_values(mine[0])
                torch.sub(self.master, mine[0], out=mine[0])
            elif self.master is not None:
                mine[0].copy_(self.master)
            else:
                self.own_values(mine[0])
            if exact:
                codec = FP32
            yield from allgather_steps(self.team, mine, gathered, codec, staging)
            flat = gathered.view(-1)
            with torch.no_grad():
                for param, seg, _ in self._segments:
                    view = flat[seg.offset : seg.offset + seg.length]
                    if seg.length == param.numel():
                        target, view = param, view.view(param.shape)  # whole: any memory layout
                    else:
                        target = param.view(-1)[seg.start : seg.start + seg.length]  # cut: contiguous
                    if delta:
                        target.add_(view)
                    else:
                        target.copy_(view)
        finally:
            on_done(staging)
