"""PowerSGD's math as pure functions (no MPI): the shapes it compresses, the power step, the Q's.

:mod:`lightning_mpi.rules.powersgd.rule` has the algorithm in its docstring and the rule;
:mod:`lightning_mpi.rules.powersgd.bucket` one bucket's exchange. Both use these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(n, m)``: a tensor of ``shape`` viewed as ``(shape[0], rest)``; ``None`` for 0-D and 1-D."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = 1
    for size in shape[1:]:
        m *= int(size)
    return n, m


def compression_rank(shape: Sequence[int], rank: int, min_compression_rate: float) -> int:
    """The rank ``r = min(n, m, rank)`` to compress a tensor of ``shape`` with, or 0 to average it
    uncompressed: 1-D (or empty) tensors, and those where ``(n + m)·r·min_compression_rate`` is
    not below ``n·m`` (torch's ``_should_compress``)."""
    nm = matrix_shape(shape)
    if nm is None or nm[0] * nm[1] == 0:
        return 0
    n, m = nm
    r = min(n, m, rank)
    return r if (n + m) * r * min_compression_rate < n * m else 0


def orthogonalize_(matrix: Tensor) -> Tensor:
    """Replace the columns of ``matrix`` (``n × r``, r ≤ n) by orthonormal ones spanning at least
    the same space, in place; returns ``matrix``.

    One column is divided by its norm (a zero column stays zero); several go through
    ``torch.linalg.qr`` (Householder), whose Q spans the input's columns even when they are
    linearly dependent, which keeps full-rank PowerSGD exact where Gram-Schmidt would divide by 0.
    """
    if matrix.shape[1] == 1:
        norm = torch.linalg.vector_norm(matrix)
        return matrix.div_(norm.clamp_min(torch.finfo(matrix.dtype).tiny))
    q, _ = torch.linalg.qr(matrix)
    return matrix.copy_(q)


def power_step(matrices: Sequence[Tensor], q: Tensor) -> tuple[Tensor, Tensor]:
    """One PowerSGD step over W ranks' matrices ``Mᵢ`` (``n × m``) from ``q`` (``m × r``), in one
    process: returns ``(P̂ Qᵀ, Q)`` where Q is the averaged new Q. The reference the rule is
    tested against; the rule computes the same with two Allreduces."""
    q = orthogonalize_(q.clone())
    p = orthogonalize_(torch.stack([mi @ q for mi in matrices]).mean(dim=0))
    new_q = torch.stack([mi.t() @ p for mi in matrices]).mean(dim=0)
    return p @ new_q.t(), new_q


def q_seed(seed: int, step: int, bucket: int) -> int:
    """Seed of the fresh Q's of ``bucket`` at ``step``: the same on every rank, different per step
    (a fixed projection would leave the same directions unsynchronised every step)."""
    return (seed * 1_000_003 + step * 7_919 + bucket) % (2**63 - 1)


def random_qs(shapes: Sequence[tuple[int, int]], seed: int, dtype: torch.dtype) -> list[Tensor]:
    """Standard normal ``(m, r)`` tensors from a CPU generator seeded with ``seed`` (every rank and
    every device draws the same values)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(m, r, generator=generator, dtype=dtype) for m, r in shapes]
