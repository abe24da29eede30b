"""One bucket of PowerSGD: its buffers, its exchange as a generator, and its commit.

A :class:`PowerSGDBucket` wraps a :class:`~lightning_mpi.comm.buffers.Bucket` (the members'
gradients in one flat buffer) and adds what the power step needs (the algorithm is in
:mod:`lightning_mpi.rules.powersgd.rule`, its math in :mod:`~lightning_mpi.rules.powersgd.lowrank`):

- ``pu``: every compressed member's P, then every uncompressed member, in one flat buffer: one
  Allreduce carries all of them;
- ``q_work``: every compressed member's Q for this step, one flat buffer (the second Allreduce);
- ``q_state``: the warm-start Q's carried from step to step (identical on every rank);
- ``residual``: this rank's error feedback, shaped like the flat buffer (zero where uncompressed).

A step runs in three stages. :meth:`begin` (from a gradient hook or ``before_step``) packs the
gradients, adds the residual and computes ``P = M Q``; :meth:`steps` is the exchange (Allreduce P
and the uncompressed tensors, orthogonalise, ``Q = Mᵀ P̂``, Allreduce Q), which the progress
engine may advance from another thread while backward runs; :meth:`commit` (from ``before_step``)
writes ``P̂ Q̄ᵀ`` and the averages into the gradients and updates the residual and the warm Q.
Nothing that outlives the step (residual, ``q_state``) changes before :meth:`commit`, so an
exchange started from hooks can be dropped and redone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import Bucket
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.base import all_finite
from lightning_mpi.rules.powersgd.lowrank import orthogonalize_


@dataclass
class CompressedMember:
    """A member compressed as an ``n × m`` matrix of rank ``r``, and where its pieces live."""

    member: int  # position in the bucket
    n: int
    m: int
    r: int
    offset: int  # in the flat gradient buffer
    p_offset: int  # in ``pu``
    q_offset: int  # in ``q_work`` and ``q_state``


@dataclass(frozen=True)
class PlainMember:
    """A member averaged as it is (1-D, or not worth compressing)."""

    member: int
    numel: int
    offset: int  # in the flat gradient buffer
    pu_offset: int  # in ``pu``, after all P's


class PowerSGDBucket:
    """The PowerSGD buffers and stages of one bucket (see the module docstring).

    Args:
        bucket: the members and their flat gradient buffer.
        team: the communicator this bucket's exchanges run on (its own, so that buckets may
            progress in any order); ``None`` at world size 1.
        compress: ``compress(shape)`` gives the rank ``r`` to compress a member of that shape
            with, or 0 to average it uncompressed.
        error_feedback: keep this rank's residual ``M − P̂ Q̄ᵀ`` for the next step.
    """

    def __init__(
        self, bucket: Bucket, team: Transport | None, compress: Callable[[torch.Size], int], error_feedback: bool
    ) -> None:
        self.bucket = bucket
        self.team = team
        self.compressed: list[CompressedMember] = []
        self.plain: list[PlainMember] = []
        p_total = q_total = 0
        plain_shapes = []
        for member, (tensor, offset) in enumerate(zip(bucket.tensors, bucket.offsets, strict=True)):
            r = compress(tensor.shape)
            if r:
                n = tensor.shape[0]
                m = tensor.numel() // n
                self.compressed.append(CompressedMember(member, n, m, r, offset, p_total, q_total))
                p_total += n * r
                q_total += m * r
            else:
                plain_shapes.append((member, tensor.numel(), offset))
        u_total = p_total
        for member, numel, offset in plain_shapes:
            self.plain.append(PlainMember(member, numel, offset, u_total))
            u_total += numel
        flat = bucket.flat
        self.pu = flat.new_zeros(u_total)
        self.q_work = flat.new_zeros(q_total)
        self.q_state = flat.new_zeros(q_total)
        self.q_ready = False  # q_state holds the last step's Q (warm start)
        self.residual = torch.zeros_like(flat) if error_feedback and self.compressed else None

    # -- views -----------------------------------------------------------------------------------
    def matrix(self, c: CompressedMember) -> Tensor:
        """The member's gradient in the flat buffer, as an ``n × m`` matrix."""
        return self.bucket.flat[c.offset : c.offset + c.n * c.m].view(c.n, c.m)

    def p(self, c: CompressedMember) -> Tensor:
        return self.pu[c.p_offset : c.p_offset + c.n * c.r].view(c.n, c.r)

    def q(self, c: CompressedMember, buffer: Tensor) -> Tensor:
        """The member's Q in ``buffer`` (``q_work`` or ``q_state``)."""
        return buffer[c.q_offset : c.q_offset + c.m * c.r].view(c.m, c.r)

    def residual_of(self, c: CompressedMember) -> Tensor:
        assert self.residual is not None
        return self.residual[c.offset : c.offset + c.n * c.m].view(c.n, c.m)

    # -- bytes -------------------------------------------------------------------------------------
    def wire_numel(self, compressing: bool) -> int:
        """Entries this bucket allreduces in one step."""
        if not compressing:
            return self.bucket.flat.numel()
        return self.pu.numel() + self.q_work.numel()

    # -- the three stages --------------------------------------------------------------------------
    def begin(self, compressing: bool, fresh_q: Callable[[list[tuple[int, int]]], list[Tensor]] | None) -> None:
        """Pack the gradients; when ``compressing``, add the residual and compute every ``P = M Q``.

        ``fresh_q(shapes)`` gives new random ``(m, r)`` Q's (the same on every rank); it is used
        when there is no warm Q (first compressed step, ``warm_start=False``, or after a Q went
        non-finite), else the warm Q's are copied from ``q_state``. Either way Q is
        orthogonalised before use, as torch's hook does.
        """
        self.bucket.pack_grads()
        if not compressing:
            return
        flat = self.bucket.flat
        if self.residual is not None:
            flat.add_(self.residual)
        if self.compressed:
            if self.q_ready and fresh_q is None:
                self.q_work.copy_(self.q_state)
            else:
                assert fresh_q is not None
                randoms = fresh_q([(c.m, c.r) for c in self.compressed])
                for c, values in zip(self.compressed, randoms, strict=True):
                    self.q(c, self.q_work).copy_(values)
            for c in self.compressed:
                q = orthogonalize_(self.q(c, self.q_work))
                torch.mm(self.matrix(c), q, out=self.p(c))
        for u in self.plain:
            self.pu[u.pu_offset : u.pu_offset + u.numel].copy_(flat[u.offset : u.offset + u.numel])

    def steps(self, compressing: bool) -> Exchange:
        """The exchange: Allreduce-mean of P's and plain members, orthogonalise, ``Q = Mᵀ P̂``,
        Allreduce-mean of Q's. Uncompressing steps allreduce the whole flat buffer."""
        team = self.team
        assert team is not None
        if not compressing:
            flat = self.bucket.flat
            yield from team.iallreduce_(flat)
            flat.div_(team.size)
            return
        yield from team.iallreduce_(self.pu)
        self.pu.div_(team.size)
        if not self.compressed:
            return
        for c in self.compressed:
            p = orthogonalize_(self.p(c))
            torch.mm(self.matrix(c).t(), p, out=self.q(c, self.q_work))
        yield from team.iallreduce_(self.q_work)
        self.q_work.div_(team.size)

    def commit(self, compressing: bool, warm_start: bool) -> bool:
        """Write the exchanged gradients into the members' ``.grad``; keep residual and warm Q.

        Returns whether the exchanged gradients are finite (the same answer on every rank). A
        non-finite Q is not kept: the next step starts from a fresh random Q.
        """
        flat = self.bucket.flat
        if compressing:
            for c in self.compressed:
                matrix = self.matrix(c)
                if self.residual is not None:
                    residual = self.residual_of(c)
                    residual.copy_(matrix)  # M + e ...
                    torch.mm(self.p(c), self.q(c, self.q_work).t(), out=matrix)
                    residual.sub_(matrix)  # ... minus what every rank applies
                else:
                    torch.mm(self.p(c), self.q(c, self.q_work).t(), out=matrix)
            for u in self.plain:
                flat[u.offset : u.offset + u.numel].copy_(self.pu[u.pu_offset : u.pu_offset + u.numel])
            if warm_start and self.compressed:
                self.q_ready = all_finite([self.q_work])
                if self.q_ready:
                    self.q_state.copy_(self.q_work)
        self.bucket.unpack_grads()
        return all_finite([flat])

    def forget_non_finite(self) -> None:
        """After a skipped step: no inf/NaN may live on in the residual."""
        if self.residual is not None:
            torch.nan_to_num_(self.residual, nan=0.0, posinf=0.0, neginf=0.0)
