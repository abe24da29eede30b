"""Top-k sparsification: each rank sends its ``k`` largest-magnitude entries as (index, value) pairs.

Top-k does not fit ASA: ranks choose different indices, so there is no chunk to own. Every rank
sends a fixed ``k`` (sizes are known in advance), one ``Allgather`` of ``2k`` 32-bit words per rank
(``int32`` indices, then the ``float32`` values as raw words) brings every rank all pairs, and a
local scatter-add in rank order builds the same sum everywhere (Aji & Heafield 2017; Lin et al.'s
Deep Gradient Compression 2018). ``"delta16"`` rows (:func:`pack_delta16`) carry an entry in one
word instead, the 16-bit gap from the previous index and the bfloat16 value, so the same bytes
carry about twice the entries; the rounding stays in the residual.

With error feedback the unsent entries stay in a residual and join the next step's gradient.
With DGC's momentum correction the momentum is accumulated locally before selection
(``u = m·u + g; v = v + u``), ``v`` is what is selected from, and both ``u`` and ``v`` are cleared
where entries were sent (momentum factor masking). With ``sections`` the ``k`` entries are chosen
section by section (one per tensor: DGC's layer-wise selection), ``k_i`` of section ``i``; the
wire is the same, ``k = sum(k_i)`` pairs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_mpi.comm.engine import Exchange
from lightning_mpi.comm.transport import Transport


def topk_count(numel: int, ratio: float) -> int:
    """How many entries of ``numel`` a rank sends at ``ratio`` (at least one, at most all)."""
    return max(1, min(numel, math.ceil(ratio * numel - 1e-9))) if numel else 0


#: Sample size for the threshold estimate of :func:`topk_select`.
_SAMPLE = 1 << 15
_SAMPLE_INDEX: dict[tuple[int, torch.device], Tensor] = {}


def _sample_index(numel: int, device: torch.device) -> Tensor:
    """Fixed pseudo-random positions in ``[0, numel)`` (deterministic: the same every step and run)."""
    key = (numel, device)
    index = _SAMPLE_INDEX.get(key)
    if index is None:
        gen = torch.Generator().manual_seed(numel)
        index = _SAMPLE_INDEX[key] = torch.randint(0, numel, (_SAMPLE,), generator=gen).to(device)
    return index


def topk_select(values: Tensor, k: int, magnitude: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
    """Indices of the ``k`` largest-magnitude entries of the 1-D ``values``.

    On CPU, ``torch.topk`` over millions of entries costs as much as ~80 passes over them. For
    large inputs with ``k`` at most a quarter of them, this instead finds a threshold that a little
    over ``k`` entries reach (``1.2 k`` at 1%), from a fixed sample of ``|values|``; keeps the
    entries at or above it (one compare, one ``nonzero``); and cuts those candidates at their exact
    k-th largest magnitude (``kthvalue``), taking the lowest indices among ties. The result is
    exact, and comes in ascending order, which helps the gathers and scatters that follow. When
    fewer than ``k`` entries reach the threshold (rare: it sits four standard deviations of the
    sample above the expected one), it falls back to ``torch.topk``, as it does for small or dense
    selections (indices then unordered). Ties at the k-th magnitude may be broken differently from
    ``torch.topk``.

    ``magnitude`` (float, like ``values``) and ``mask`` (bool, like ``values``) are optional scratch.
    Counting the candidates reads a size on the host (``nonzero`` does so on a GPU anyway).
    """
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    magnitude = torch.abs(values, out=magnitude) if magnitude is not None else values.abs()
    if n < 8 * _SAMPLE or 4 * k > n:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[_sample_index(n, values.device)]
    expected = k * _SAMPLE / n  # sample entries expected above the k-th largest magnitude
    above = min(_SAMPLE, int(expected + 4 * math.sqrt(expected) + 2))
    threshold = torch.kthvalue(sample, _SAMPLE - above + 1).values
    mask = torch.ge(magnitude, threshold, out=mask) if mask is not None else magnitude >= threshold
    candidates = mask.nonzero().view(-1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    picked = magnitude[candidates]
    kth = torch.kthvalue(picked, picked.numel() - k + 1).values  # the k-th largest magnitude
    keep = picked > kth
    missing = k - int(keep.sum())  # entries equal to kth still to take, lowest index first
    if missing > 0:
        keep[(picked == kth).nonzero().view(-1)[:missing]] = True
    return candidates[keep]


#: A section of a flat buffer: (offset, numel, k): choose ``k`` entries among ``flat[offset:offset+numel]``.
Section = tuple[int, int, int]


def section_counts(sizes: list[int], ratio: float) -> list[int]:
    """``k`` of each section of ``sizes`` entries at ``ratio`` (:func:`topk_count` each: at least one)."""
    return [topk_count(n, ratio) for n in sizes]


def topk_select_sections(
    values: Tensor, sections: list[Section], magnitude: Tensor | None = None, mask: Tensor | None = None
) -> Tensor:
    """:func:`topk_select` section by section: the indices (into ``values``) of each section's
    ``k`` largest-magnitude entries, sections in order. ``magnitude`` and ``mask``: scratch like
    ``values`` (or ``None``)."""
    picked = []
    for offset, numel, k in sections:
        if k == 0:
            continue
        end = offset + numel
        part = topk_select(
            values[offset:end],
            k,
            magnitude[offset:end] if magnitude is not None else None,
            mask[offset:end] if mask is not None else None,
        )
        picked.append(part.add_(offset) if offset else part)
    return torch.cat(picked) if len(picked) != 1 else picked[0]


def pack_pairs(values: Tensor, index: Tensor, wire: Tensor) -> None:
    """Write ``index`` and ``values[index]`` into the ``int32[2k]`` ``wire``."""
    k = index.numel()
    wire[:k].copy_(index)
    wire[k:].view(torch.float32).copy_(values[index])


def scatter_pairs_(out: Tensor, wire: Tensor) -> None:
    """``out[index] += value`` for the pairs in one ``int32[2k]`` wire row."""
    k = wire.numel() // 2
    out.index_add_(0, wire[:k].long(), wire[k:].view(torch.float32))


#: Largest index gap one ``"delta16"`` word carries; a longer gap takes filler words of this gap.
_GAP = (1 << 16) - 1


def delta16_fillers(numel: int) -> int:
    """The most filler words the gaps of a ``"delta16"`` row over ``numel`` entries can need."""
    return (numel - 1) // _GAP if numel else 0


def delta16_counts(numel: int, words: int) -> int:
    """Entries a ``"delta16"`` row of ``words`` 32-bit words carries for a buffer of ``numel``:
    what is left after room for the filler words the longest gaps may need (at least one, at most all)."""
    return max(1, min(numel, words - delta16_fillers(numel))) if numel else 0


def pack_delta16(values: Tensor, index: Tensor, wire: Tensor) -> tuple[Tensor, Tensor]:
    """Write ``values[index]`` into the ``int32`` ``wire`` as ``"delta16"`` words and return what
    the receivers will decode (the values rounded to bfloat16) and the indices, sorted, for the residual.

    A word holds the gap from the previous index (from 0 for the first) in its high 16 bits and
    the value's bfloat16 bits (the high half of its float32) in its low 16. A gap above 65,535
    takes filler words (gap 65,535, value 0) before it; unused words at the end are (0, 0), which
    adds zero to the last index. ``wire`` must have room: :func:`delta16_counts`."""
    index, _ = torch.sort(index)
    sent = values[index].to(torch.bfloat16)
    gaps = torch.diff(index, prepend=index.new_zeros(1))
    fillers = torch.clamp((gaps - 1) // _GAP, min=0)  # words of gap _GAP before each entry
    gaps = gaps - fillers * _GAP
    bits = sent.view(torch.int16).to(torch.int64) & 0xFFFF
    words = (gaps << 16) | bits
    if int(fillers.sum()):
        per_entry = fillers + 1
        words = torch.repeat_interleave(words, per_entry)
        filler = torch.ones_like(words, dtype=torch.bool)
        filler[torch.cumsum(per_entry, 0) - 1] = False  # the last word of each group is the entry
        words[filler] = _GAP << 16
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # as int32 bits
    wire.zero_()
    wire[: words.numel()].copy_(words)
    return sent.to(values.dtype), index


def scatter_delta16_(out: Tensor, wire: Tensor) -> None:
    """``out[index] += value`` for the words of one ``"delta16"`` row (:func:`pack_delta16`)."""
    words = wire.to(torch.int64) & 0xFFFFFFFF
    index = torch.cumsum(words >> 16, 0)
    bits = (words & 0xFFFF) << 16
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    out.index_add_(0, index, bits.view(torch.float32).to(out.dtype))


class TopKWorkspace:
    """Send row ``[1, 2k]`` and gathered rows ``[world, 2k]`` for the current ``k``, plus
    selection scratch shaped like the exchanged buffer (kept when ``k`` changes)."""

    def __init__(
        self, k: int, world: int, device: torch.device, numel: int = 0, dtype: torch.dtype = torch.float32
    ) -> None:
        self.world, self.device = world, device
        self.magnitude = torch.empty(numel, dtype=dtype, device=device) if numel else None
        self.mask = torch.empty(numel, dtype=torch.bool, device=device) if numel else None
        self.k = self.words = -1
        self.resize(k)

    def resize(self, k: int, words: int | None = None) -> TopKWorkspace:
        """Wire buffers for ``k`` pairs, or rows of ``words`` words (``"delta16"``); reallocated
        only when they change (ratio warm-up)."""
        words = 2 * k if words is None else words
        if (k, words) != (self.k, self.words):
            self.k, self.words = k, words
            self.send = torch.empty(1, words, dtype=torch.int32, device=self.device)
            self.recv = torch.empty(self.world, words, dtype=torch.int32, device=self.device)
        return self


def topk_mean_steps(
    transport: Transport,
    flat: Tensor,
    k: int,
    work: TopKWorkspace,
    residual: Tensor | None = None,
    momentum_buf: Tensor | None = None,
    momentum: float = 0.0,
    sections: list[Section] | None = None,
    mask_momentum: bool = True,
    packing: str = "pairs",
) -> Exchange:
    """Mean over ranks of every rank's top-``k`` entries, left dense in ``flat`` on every rank.

    ``k`` counts entries of ``flat[:numel]`` for the caller's ``numel``; ``residual`` (error
    feedback) and ``momentum_buf`` (momentum correction) are shaped like ``flat`` or ``None``.
    ``sections`` (their ``k_i`` summing to ``k``): choose per section instead of over all of ``flat``.
    ``mask_momentum``: clear ``momentum_buf`` where entries were sent (DGC's momentum factor masking).
    ``packing``: ``"pairs"`` (an int32 index and a float32 value per entry) or ``"delta16"`` (one
    word per entry, :func:`pack_delta16`, in the workspace's rows; the bfloat16 rounding of what
    was sent stays in ``residual``).
    """
    world = transport.size
    source = flat
    if momentum_buf is not None:
        momentum_buf.mul_(momentum).add_(flat)  # u = m·u + g
        source = momentum_buf
    if residual is not None:
        residual.add_(source)  # v = v + (u or g)
        source = residual
    n = source.numel()
    scratch = work.magnitude is not None and work.magnitude.numel() == n and source.dtype == work.magnitude.dtype
    magnitude, mask = (work.magnitude, work.mask) if scratch else (None, None)
    if sections is not None:
        index = topk_select_sections(source, sections, magnitude, mask)
    else:
        index = topk_select(source, k, magnitude, mask)
    if packing == "delta16":
        sent, index = pack_delta16(source, index, work.send[0])
        if residual is not None:
            residual[index] -= sent  # v - what the receivers decode: the rounding waits here
    else:
        pack_pairs(source, index, work.send[0])
        if residual is not None:
            residual[index] = 0
    if momentum_buf is not None and mask_momentum:
        momentum_buf[index] = 0
    yield from transport.iallgather(work.send, work.recv)
    flat.zero_()
    scatter = scatter_delta16_ if packing == "delta16" else scatter_pairs_
    for row in work.recv:  # rank order: the same sum on every rank
        scatter(flat, row)
    flat.div_(world)
