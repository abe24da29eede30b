"""One fragment of the model for the outer loop across replicas, and its sharded exchange.

A :class:`ReplicaFragment` holds, for its tensors: the flat local weights (a padded view of the
parameters, :class:`~lightning_mpi.rules.easgd.FlatParams`), the global weights θ_global and the
pseudo-gradient Δ, whole on every rank, and the :class:`Piece`\\ s of Δ this rank carries across
replicas (:mod:`.layout`). The members of a replica hold the same weights (they synchronize every
step), so they hold the same Δ; the mean of Δ over the replicas is therefore taken in pieces:

1. each piece this rank carries is averaged over the ranks that carry it, one per replica, with
   the wire's codec: one Allreduce (fp32), ASA with error feedback
   (:func:`~lightning_mpi.comm.collectives.asa_mean_steps`: bf16, int8, int4) on the piece, or
   SparseLoCo's wire (:func:`~lightning_mpi.comm.sparseloco.sparseloco_mean_steps`: the piece's
   real entries as one section, chunks of 4096 sending their largest entries with 2-bit values,
   one Allgather, a decaying error-feedback accumulator);
2. one Allgather inside the replica gives every member every piece of the mean.

So a replica sends its Δ across once, split over its members' links, and every member ends with
the same mean Δ, bitwise, on every rank of the run (each piece is averaged once, then copied). The
error-feedback residuals of a piece, and SparseLoCo's accumulator (in :attr:`Piece.residual`), are
its carrier's own. SparseLoCo's wire runs on one replica too (its accumulator is part of the
algorithm, as in :mod:`lightning_mpi.rules.diloco.fragments`); the dense wires leave one replica's
Δ as it is. Buffers are padded to a multiple of ``S·R`` (pieces times replicas), and the padding
stays zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_mpi.comm.collectives import ASAWorkspace, allreduce_mean_steps, asa_mean_steps
from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.sparseloco import SparseLayout, SparseLoCoWire, SparseLoCoWorkspace, sparseloco_mean_steps
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.diloco.fragments import Wire, exchange_bytes
from lightning_mpi.rules.easgd import FlatParams
from lightning_mpi.rules.hybrid.layout import Layout


class Piece:
    """Piece ``index`` of a fragment's Δ (``view``, a row of it), averaged over ``team`` (its carriers,
    one per replica) with ``codec``; a lossy codec keeps this rank's residuals of it, SparseLoCo's
    its accumulator (in :attr:`residual`).

    Args:
        view: the piece, a contiguous row of the fragment's padded Δ.
        team: the ranks that carry this piece, one per replica.
        codec: the wire; a lossy dense one (on more than one replica) gets error feedback, SparseLoCo's
            (on any number of replicas) its accumulator over the piece's real entries, one section.
        real: how many of the piece's entries are weights (the rest is padding, kept zero).
        error_decay: β of SparseLoCo's accumulator, ``e ← β·e + Δ`` (its wire only).
    """

    def __init__(
        self, index: int, view: Tensor, team: Transport, codec: Wire, real: int, error_decay: float = 1.0
    ) -> None:
        self.index = index
        self.view = view
        self.team = team
        self.codec = codec
        self.real = real
        self.error_decay = error_decay
        self.sparse: SparseLoCoWorkspace | None = None
        self.work: ASAWorkspace | None = None
        self.residual: Tensor | None = None
        self.owner_residual: Tensor | None = None
        if isinstance(codec, SparseLoCoWire):
            layout = SparseLayout(codec, [(0, real)], view.device)
            self.sparse = SparseLoCoWorkspace(layout, team.size, view.device)
            self.residual = torch.zeros_like(view)
            #: bytes this rank sends across replicas per exchange of the piece
            self.bytes_per_exchange = codec.exchange_bytes([real], team.size)
        else:
            lossy = codec.lossy and team.size > 1
            self.residual = torch.zeros_like(view) if lossy else None
            self.owner_residual = view.new_zeros(view.numel() // team.size) if lossy else None
            self.work = ASAWorkspace.for_buffer(view, team.size, codec) if lossy else None
            self.bytes_per_exchange = exchange_bytes(view.numel(), team.size, codec)

    def mean_steps(self) -> Exchange:
        """The mean of the piece over the replicas, in place."""
        codec = self.codec
        if isinstance(codec, SparseLoCoWire):  # its accumulator runs on one replica too
            if self.sparse is not None and self.residual is not None:
                yield from sparseloco_mean_steps(self.team, self.view, self.sparse, self.residual, self.error_decay)
        elif self.team.size == 1:
            return
        elif self.work is None:
            yield from allreduce_mean_steps(self.team, self.view)
        else:
            yield from asa_mean_steps(self.team, self.view, codec, self.work, self.residual, self.owner_residual)
        # Padding must stay zero (it is neither a weight nor a residual).
        self.view[self.real :].zero_()
        if self.residual is not None:
            self.residual[self.real :].zero_()
        if self.owner_residual is not None:
            chunk = self.owner_residual.numel()
            self.owner_residual[min(chunk, max(0, self.real - self.team.rank * chunk)) :].zero_()


class ReplicaFragment:
    """Local and global weights, Δ and the carried pieces of one group of whole tensors.

    An exchange goes ``idle`` → ``running`` (started, non-blocking) → ``arrived`` (the mean Δ is in
    :attr:`delta`, identical on every rank) → ``idle`` once the outer step has used it.

    Args:
        params: the fragment's parameters (one dtype, one device), in model order.
        layout: this rank's place (:class:`~.layout.Layout`).
        codec: the wire of the pieces across replicas.
        error_decay: β of SparseLoCo's accumulator (its wire only).
    """

    def __init__(self, params: Sequence[Tensor], layout: Layout, codec: Wire, error_decay: float = 1.0) -> None:
        pieces, replicas = layout.pieces, layout.replicas
        self.local = FlatParams(params, pieces * replicas)
        self.numel = self.local.bucket.numel
        self.replicas = replicas
        self.theta_global = self.local.pull().clone()
        self.delta = torch.zeros_like(self.theta_global)
        self.rows = self.delta.view(pieces, -1)
        length = self.rows.shape[1]
        self.pieces = {
            k: Piece(k, self.rows[k], layout.cross[k], codec, max(0, min(length, self.numel - k * length)), error_decay)
            for k in layout.mine
        }
        #: whether an exchange runs at all: across replicas, or SparseLoCo's wire on one (module docstring)
        self.exchanges = replicas > 1 or isinstance(codec, SparseLoCoWire)
        self.member, self.size = layout.member, layout.size
        self.gather = layout.gather
        slots = math.ceil(pieces / self.size)
        self._send = self.delta.new_zeros(slots * length)
        self._recv = self.delta.new_zeros(self.size, slots * length)
        self.status = "idle"
        self.due = 0  # the step at which the running or arrived exchange is applied
        self.started = 0  # the step at which the last exchange started
        #: bytes this rank sends across replicas per exchange (its pieces), and inside its replica
        self.bytes_per_exchange = sum(piece.bytes_per_exchange for piece in self.pieces.values())
        self.gather_bytes = (self.size - 1) * self._send.numel() * self.delta.element_size() if self.exchanges else 0

    def adopt_local(self) -> None:
        """θ_global ← the current local weights (at train start, when every rank holds the same)."""
        self.theta_global.copy_(self.local.pull())

    def mean_steps(self) -> Exchange:
        """Average :attr:`delta` over the replicas: this rank's pieces across, then the Allgather
        inside the replica (module docstring). One replica: Δ is its own mean (SparseLoCo's wire
        still runs: its accumulator is part of the algorithm)."""
        if not self.exchanges:
            return
        for piece in self.pieces.values():
            yield from piece.mean_steps()
        if self.size == 1:
            return
        length = self.rows.shape[1]
        slots = self._send.view(-1, length)
        for slot, k in enumerate(self.pieces):
            slots[slot].copy_(self.rows[k])
        yield from self.gather.iallgather(self._send, self._recv)
        gathered = self._recv.view(self.size, -1, length)
        for k in range(self.rows.shape[0]):
            self.rows[k].copy_(gathered[k % self.size, k // self.size])

    # -- what a checkpoint and a heal keep of this rank's own ----------------------------------------
    def residuals(self) -> dict[int, tuple[Tensor | None, Tensor | None]]:
        """This rank's residuals of each piece it carries (copies)."""
        return {
            k: (
                None if p.residual is None else p.residual.clone(),
                None if p.owner_residual is None else p.owner_residual.clone(),
            )
            for k, p in self.pieces.items()
        }

    def load_residuals(self, saved: dict[int, tuple[Tensor | None, Tensor | None]] | None) -> None:
        """Put back what :meth:`residuals` returned (same layout); ``None``: start them at zero."""
        for k, piece in self.pieces.items():
            kept = None if saved is None else saved.get(k)
            for target, value in zip((piece.residual, piece.owner_residual), kept or (None, None), strict=True):
                if target is None:
                    continue
                target.zero_()
                if value is not None:
                    target.copy_(value)
