"""SparseLoCo's wire (lightning_mpi.comm.sparseloco) against a per-chunk reference written out by hand:
the packing, the selection and the 2-bit values, error feedback, and the bytes on the wire. The
exchange on 2 and 3 ranks against one process: tests/strategies/test_diloco.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_mpi.comm.codecs import INT4
from lightning_mpi.comm.sparseloco import (
    CHUNK,
    SparseLayout,
    SparseLoCoWire,
    SparseLoCoWorkspace,
    pack2,
    pack12,
    sparseloco_mean_steps,
    unpack2,
    unpack12,
)
from lightning_mpi.rules.diloco.fragments import exchange_bytes

CPU = torch.device("cpu")


def reference(e: torch.Tensor, sections: list[tuple[int, int]], k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """What the wire sends of ``e``, chunk by chunk in plain Python: ``(sent, levels)``: the decoded
    value of every entry sent (zero elsewhere) and each section's levels, in row order."""
    sent = torch.zeros_like(e)
    all_levels = []
    for offset, numel in sections:
        picked = []
        for start in range(0, numel, CHUNK):
            length = min(CHUNK, numel - start)
            count = k if length == CHUNK else max(1, min(length, math.ceil(k * length / CHUNK)))
            segment = e[offset + start : offset + start + length].abs()
            order = sorted(range(length), key=lambda i: -float(segment[i]))[:count]
            picked += [offset + start + i for i in sorted(order)]
        where = torch.tensor(picked)
        values = e[where].double()
        centre = values.mean()
        std = values.std() if len(picked) > 1 else torch.tensor(0.0, dtype=torch.float64)
        step = 6.0 * std / 4 if std > 0 else torch.tensor(1.0, dtype=torch.float64)
        levels = torch.clamp(torch.round((values - centre) / step + 2), 0, 3).long()
        table = torch.zeros(4, dtype=torch.float64)
        for level in range(4):
            members = values[levels == level] - centre
            if len(members):
                table[level] = members.mean()
        sent[where] = (table + centre).float()[levels]
        all_levels.append(levels)
    return sent, all_levels


def layout_of(sizes: list[int], k: int) -> tuple[SparseLayout, list[tuple[int, int]]]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    sections = list(zip(offsets, sizes))
    return SparseLayout(SparseLoCoWire(k), sections, CPU), sections


# -- packing -------------------------------------------------------------------------------------
def test_twelve_bit_indices_pack_two_to_three_bytes():
    out = torch.zeros(3, dtype=torch.uint8)
    pack12(torch.tensor([0xABC, 0x123]), out)
    assert out.tolist() == [0xBC, 0x3A, 0x12]  # low byte of the first; its high nibble, the second's low; its high byte
    values = torch.randint(0, CHUNK, (1001,))
    packed = torch.zeros(3 * 501, dtype=torch.uint8)
    pack12(values, packed)
    assert torch.equal(unpack12(packed, 1001), values)
    assert torch.equal(unpack12(packed, 1002)[-1:], torch.tensor([0]))  # the odd count's padding
    edge = torch.tensor([0, 4095, 4095, 0])
    pack12(edge, packed[:6])
    assert torch.equal(unpack12(packed[:6], 4), edge)


def test_two_bit_levels_pack_four_to_a_byte():
    out = torch.zeros(2, dtype=torch.uint8)
    pack2(torch.tensor([1, 2, 3, 0, 3]), out)
    assert out.tolist() == [1 | 2 << 2 | 3 << 4, 3]  # the first in the low bits; padded with 0
    levels = torch.randint(0, 4, (999,))
    packed = torch.zeros(250, dtype=torch.uint8)
    pack2(levels, packed)
    assert torch.equal(unpack2(packed, 999), levels)


# -- the rows against the per-chunk reference -------------------------------------------------------
@pytest.mark.parametrize(
    "sizes, k",
    [
        ([10000, 5, 4096, 1], 64),  # two full chunks and a tail; a bias of 5; one whole chunk; a scalar
        ([8192], 1),
        ([300, 4096 * 3 + 7], 4096),  # every entry of a full chunk; a tail keeps all of its length
        ([4097, 20], 7),
    ],
)
def test_a_row_decodes_to_the_per_chunk_reference(sizes, k):
    torch.manual_seed(sum(sizes) + k)
    layout, sections = layout_of(sizes, k)
    e = torch.randn(sum(sizes)) * torch.rand(sum(sizes)).pow(3)  # heavy-tailed, as pseudo-gradients are
    want, want_levels = reference(e.clone(), sections, k)
    accumulator, row = e.clone(), torch.zeros(layout.row_bytes, dtype=torch.uint8)
    layout.encode_with_feedback_(accumulator, row)
    got = torch.zeros_like(e)
    layout.scatter_add_(got, row)
    assert torch.equal(got != 0, want != 0)  # the same entries (no selected value is exactly 0 here)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)  # float64 statistics summed in another order
    levels = unpack2(row[16 * len(sizes) + 3 * -(-layout.entries // 2) :], layout.entries)
    assert torch.equal(levels, torch.cat(want_levels))
    assert layout.entries == SparseLoCoWire(k).entries(sizes) == int((want != 0).sum())
    assert len(row) == layout.row_bytes == SparseLoCoWire(k).row_bytes(sizes)


def test_error_feedback_keeps_what_was_not_sent_and_the_sum_of_each_section():
    """``e − Δ̂`` stays exactly where nothing was sent and is ``e − Δ̂`` in float32 where something was;
    every level decodes to the mean of its entries, so a section's decoded values sum to its
    selected values (to float32 rounding)."""
    torch.manual_seed(7)
    sizes = [5000, 64, 4096]
    layout, sections = layout_of(sizes, 64)
    e = torch.randn(sum(sizes))
    accumulator, row = e.clone(), torch.zeros(layout.row_bytes, dtype=torch.uint8)
    layout.encode_with_feedback_(accumulator, row)
    sent = torch.zeros_like(e)
    layout.scatter_add_(sent, row)
    mask = sent != 0
    assert torch.equal(accumulator[~mask], e[~mask])
    assert torch.equal(accumulator[mask], e[mask] - sent[mask])
    assert torch.allclose(sent + accumulator, e, rtol=0, atol=1e-6)
    for offset, numel in sections:
        part = slice(offset, offset + numel)
        assert math.isclose(float(sent[part].sum()), float(e[part][mask[part]].sum()), rel_tol=1e-5, abs_tol=1e-5)
    assert len(torch.unique(sent[sections[0][0] : sections[0][1]][mask[: sections[0][1]]])) <= 4  # 2 bits


def test_a_zero_accumulator_sends_zeros_and_a_non_finite_one_decodes_to_nan():
    layout, _ = layout_of([100, 4096], 8)
    row = torch.zeros(layout.row_bytes, dtype=torch.uint8)
    zero = torch.zeros(4196)
    layout.encode_with_feedback_(zero, row)
    out = torch.zeros(4196)
    layout.scatter_add_(out, row)
    assert not out.any() and not zero.any()
    bad = torch.randn(4196)
    bad[150] = float("nan")
    layout.encode_with_feedback_(bad, row)
    out.zero_()
    layout.scatter_add_(out, row)
    assert out[100:].isnan().any() and not out[:100].isnan().any()  # only the tensor that held it


def test_the_exchange_on_one_rank_sends_nothing_and_applies_the_decayed_accumulator():
    """World of one: ``e ← β·e + Δ``, the row is read back (the mean of one), ``e ← e − Δ̂``."""
    from mpi4py import MPI

    from lightning_mpi.comm.engine import ExchangeScheduler
    from lightning_mpi.comm.transport import Transport

    torch.manual_seed(3)
    layout, sections = layout_of([6000, 30], 16)
    work = SparseLoCoWorkspace(layout, 1, CPU)
    e, delta = torch.randn(6030), torch.randn(6030)
    accumulator, flat = e.clone(), delta.clone()
    scheduler = ExchangeScheduler()
    scheduler.start(sparseloco_mean_steps(Transport(MPI.COMM_SELF), flat, work, accumulator, 0.9))
    scheduler.wait_all()
    folded = e * 0.9 + delta
    want, _ = reference(folded.clone(), sections, 16)
    assert torch.allclose(flat, want, rtol=1e-6, atol=0)
    assert torch.equal(accumulator, folded - flat)


# -- bytes on the wire ------------------------------------------------------------------------------
def test_bytes_on_the_wire():
    wire = SparseLoCoWire(64)
    # a full chunk: 64 entries of 12 + 2 bits (112 bytes) and one section's 4 float32 levels
    assert wire.row_bytes([4096]) == 16 + 96 + 16
    assert wire.row_bytes([4096 * 10]) == 16 + 3 * 320 + 160
    assert wire.row_bytes([1]) == 4 * -(-(16 + 3 + 1) // 4)  # a scalar still sends its one entry
    assert wire.exchange_bytes([4096], 1) == 0 and wire.exchange_bytes([4096], 3) == 2 * 128
    assert exchange_bytes(4096, 3, wire, [4096]) == 2 * 128 and exchange_bytes(4096, 1, wire) == 0
    # the time-to-quality model's tensors: at most 1/16 of the dense 4-bit wire's bytes on 2 ranks
    ttq = [256 * 32, 2048 * 3072, 3072, 3072 * 3072, 3072, 3072 * 256, 256]
    numel = sum(ttq)
    dense = exchange_bytes(numel + numel % 2, 2, INT4)
    assert exchange_bytes(numel, 2, wire, ttq) <= dense / 16
    assert exchange_bytes(numel, 2, wire, ttq) * 8 / numel < 0.23  # bits per value sent
    with pytest.raises(ValueError, match="k=0"):
        SparseLoCoWire(0)
