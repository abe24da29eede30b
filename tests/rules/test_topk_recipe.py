"""The top-k recipe's math on one process (Deep Gradient Compression, Lin et al. 2018).

Layer-wise selection, momentum correction with and without momentum factor masking, the hand-off
to an optimizer that has momentum of its own, and local clipping; ``topk_mean_steps`` runs on a
world of one (``COMM_SELF``), which exercises the whole exchange but the wire.
"""

import pytest
import torch
from mpi4py import MPI

from lightning_mpi.comm.sparse import (
    TopKWorkspace,
    delta16_fillers,
    pack_delta16,
    scatter_delta16_,
    section_counts,
    topk_mean_steps,
    topk_select_sections,
)
from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.rules.compressed.exchanger import clip_
from lightning_mpi.rules.compressed.momentum_handoff import compensate_


def run(steps):
    for _ in steps:
        pass


@pytest.fixture(scope="module")
def self_transport():
    return Transport(MPI.COMM_SELF)


@pytest.mark.timeout(60)
def test_layerwise_selection_takes_k_of_every_section():
    gen = torch.Generator().manual_seed(0)
    sizes = [300, 7, 50]
    # The first tensor's entries dwarf the others: one threshold over the bucket would take only them.
    big, small, mid = (torch.randn(n, generator=gen) for n in sizes)
    values = torch.cat([100 * big, small, mid])
    counts = section_counts(sizes, 0.1)
    assert counts == [30, 1, 5]
    offsets = [0, 300, 307]
    index = topk_select_sections(values, list(zip(offsets, sizes, counts, strict=True)))
    assert index.numel() == sum(counts)
    for offset, n, k in zip(offsets, sizes, counts, strict=True):
        mine = sorted(i - offset for i in index.tolist() if offset <= i < offset + n)
        want = sorted(torch.topk(values[offset : offset + n].abs(), k).indices.tolist())
        assert mine == want


@pytest.mark.timeout(60)
def test_momentum_correction_accumulates_velocity_and_masks(self_transport):
    gen = torch.Generator().manual_seed(1)
    n, k, m = 40, 4, 0.5
    grads = [torch.randn(n, generator=gen) for _ in range(6)]
    for masking in (True, False):
        u, v = torch.zeros(n), torch.zeros(n)  # the algorithm, written out
        residual, velocity = torch.zeros(n), torch.zeros(n)  # the implementation's buffers
        work = TopKWorkspace(k, 1, torch.device("cpu"), n)
        for g in grads:
            u = m * u + g
            v = v + u
            sent = torch.topk(v.abs(), k).indices
            want = torch.zeros(n)
            want[sent] = v[sent]
            v[sent] = 0
            if masking:
                u[sent] = 0
            flat = g.clone()
            run(topk_mean_steps(self_transport, flat, k, work, residual, velocity, m, mask_momentum=masking))
            torch.testing.assert_close(flat, want)
            torch.testing.assert_close(residual, v)
            torch.testing.assert_close(velocity, u)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_compensation_makes_the_optimizer_momentum_buffer_the_exchanged_update(dampening):
    """SGD with momentum, handed ``compensate_``'s gradient, steps by exactly the exchanged ``S_t``."""
    gen = torch.Generator().manual_seed(2)
    m, lr = 0.9, 0.1
    p = torch.zeros(25, requires_grad=True)
    opt = torch.optim.SGD([p], lr=lr, momentum=m, dampening=dampening)
    previous = torch.zeros(25)
    want = torch.zeros(25)
    for step in range(8):
        update = torch.randn(25, generator=gen)
        p.grad = update.clone()
        compensate_(p.grad, previous, m, dampening, first=step == 0)
        opt.step()
        want -= lr * update
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], update)
        torch.testing.assert_close(previous, update)
    torch.testing.assert_close(p.detach(), want)


@pytest.mark.timeout(60)
def test_ratio_one_without_masking_is_the_dense_optimizer(self_transport):
    """At ratio 1, unmasked momentum correction + compensation = plain SGD with momentum."""
    gen = torch.Generator().manual_seed(3)
    m, lr, n = 0.9, 0.05, 30
    grads = [torch.randn(n, generator=gen) for _ in range(10)]
    dense = torch.zeros(n, requires_grad=True)
    sparse = torch.zeros(n, requires_grad=True)
    opt_d = torch.optim.SGD([dense], lr=lr, momentum=m)
    opt_s = torch.optim.SGD([sparse], lr=lr, momentum=m)
    residual, velocity, previous = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    work = TopKWorkspace(n, 1, torch.device("cpu"), n)
    for step, g in enumerate(grads):
        dense.grad = g.clone()
        opt_d.step()
        flat = g.clone()
        run(topk_mean_steps(self_transport, flat, n, work, residual, velocity, m, mask_momentum=False))
        compensate_(flat, previous, m, 0.0, first=step == 0)
        sparse.grad = flat
        opt_s.step()
    torch.testing.assert_close(sparse.detach(), dense.detach())


@pytest.mark.timeout(60)
def test_local_clipping_scales_down_only():
    g = torch.tensor([3.0, 4.0])
    clip_(g, 1.0)
    torch.testing.assert_close(torch.linalg.vector_norm(g), torch.tensor(1.0), atol=1e-5, rtol=0)
    small = torch.tensor([0.3, 0.4])
    clip_(small, 1.0)
    torch.testing.assert_close(small, torch.tensor([0.3, 0.4]))


@pytest.mark.timeout(60)
def test_recipe_defaults_and_bad_input():
    rule = CompressedSyncRule(wire="topk")
    assert rule.ratio_warmup_steps == 40 and rule.ratio_at(0) == 1.0 and rule.ratio_at(40) == 0.01
    assert not rule.corrects_momentum and not rule.layerwise and rule.clip_norm is None  # measured: off
    assert rule.topk_packing == "delta16"  # measured: on
    assert CompressedSyncRule(wire="topk", momentum_correction=True).corrects_momentum
    with pytest.raises(ValueError, match="clip_norm="):
        CompressedSyncRule(wire="topk", clip_norm=0.0)
    with pytest.raises(ValueError, match="clip_norm="):
        CompressedSyncRule(wire="int8", clip_norm=1.0)
    with pytest.raises(ValueError, match="momentum="):
        CompressedSyncRule(wire="topk", momentum=1.5)


@pytest.mark.timeout(60)
def test_layerwise_sections_follow_the_bucket_members(self_transport):
    from lightning_mpi.comm.buffers import make_buckets
    from lightning_mpi.rules.compressed.exchanger import CompressedExchanger

    tensors = [torch.zeros(300), torch.zeros(7), torch.zeros(5, 10)]
    (bucket,) = make_buckets(tensors, 1, bucket_bytes=None)
    exchanger = CompressedExchanger(self_transport, CompressedSyncRule(wire="topk", ratio=0.1, layerwise=True, topk_packing="pairs"))
    exchanger.prepare([bucket])
    exchanger.step = 10**6  # past the warm-up
    state = next(iter(exchanger._states.values()))
    sections, counts = exchanger._sections(state)
    members = [t.numel() for t in bucket.tensors]
    assert [(o, n) for o, n, _ in sections] == list(zip(bucket.offsets, members, strict=True))
    assert counts == [k for _, _, k in sections] == section_counts(members, 0.1)
    exchanger.close()


@pytest.mark.timeout(60)
def test_warmup_can_start_below_one():
    rule = CompressedSyncRule(wire="topk", ratio=0.01, ratio_warmup_steps=4, ratio_warmup_start=0.25)
    ratios = [rule.ratio_at(s) for s in range(6)]
    assert ratios[0] == 0.25 and ratios[4] == ratios[5] == 0.01
    assert abs(ratios[2] - 0.05) < 1e-12  # geometric: sqrt(0.25 * 0.01)
    assert CompressedSyncRule(wire="topk", ratio=0.5, ratio_warmup_start=0.25).ratio_at(0) == 0.5  # never below ratio
    with pytest.raises(ValueError, match="ratio_warmup_start="):
        CompressedSyncRule(wire="topk", ratio_warmup_start=0.0)


@pytest.mark.timeout(60)
def test_delta16_rows_round_trip_long_gaps():
    """Gaps above 16 bits take filler words; the values arrive rounded to bfloat16."""
    n = 200_000
    values = torch.randn(n, generator=torch.Generator().manual_seed(5))
    index = torch.tensor([199_999, 0, 1, 65_536, 131_073])  # any order; gaps of 65,535 and more
    wire = torch.empty(index.numel() + delta16_fillers(n) + 2, dtype=torch.int32)  # 2 unused words
    sent, order = pack_delta16(values, index, wire)
    assert order.tolist() == sorted(index.tolist())
    torch.testing.assert_close(sent, values[order].bfloat16().float(), rtol=0, atol=0)
    out = torch.zeros(n)
    scatter_delta16_(out, wire)
    want = torch.zeros(n)
    want[index] = values[index].bfloat16().float()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_delta16_sends_twice_the_entries_and_keeps_the_rounding(self_transport):
    """With ``"delta16"`` the exchange sends the top ``2k`` of ``v`` in the bytes of ``k`` pairs; what
    the receivers decode is ``v`` rounded to bfloat16, and the rounding stays in the residual."""
    from lightning_mpi.comm.buffers import make_buckets
    from lightning_mpi.rules.compressed.exchanger import CompressedExchanger

    gen = torch.Generator().manual_seed(6)
    n, k = 500, 10
    residual, v = torch.zeros(n), torch.zeros(n)
    work = TopKWorkspace(2 * k, 1, torch.device("cpu"), n)
    for _ in range(5):
        g = torch.randn(n, generator=gen)
        v += g
        sent = torch.topk(v.abs(), 2 * k).indices
        want = torch.zeros(n)
        want[sent] = v[sent].bfloat16().float()
        v[sent] -= want[sent]
        flat = g.clone()
        run(topk_mean_steps(self_transport, flat, 2 * k, work, residual, packing="delta16"))
        torch.testing.assert_close(flat, want, rtol=0, atol=0)
        torch.testing.assert_close(residual, v)
    # In the rule: twice the entries of "pairs" in the same bytes, past the warm-up.
    (bucket,) = make_buckets([torch.zeros(300), torch.zeros(7, 10)], 1, bucket_bytes=None)
    counts, nbytes = [], []
    for packing in ("pairs", "delta16"):
        exchanger = CompressedExchanger(self_transport, CompressedSyncRule(wire="topk", topk_packing=packing))
        exchanger.prepare([bucket])
        exchanger.step = 10**6
        state = next(iter(exchanger._states.values()))
        counts.append(exchanger._sections(state)[1][0])
        nbytes.append(4 * exchanger._row_words(state, counts[-1]))
        exchanger.close()
    assert counts == [4, 8] and nbytes == [32, 32]  # ceil(0.01 * 370) = 4 pairs
    with pytest.raises(ValueError, match="layerwise=True needs topk_packing='pairs'"):
        CompressedSyncRule(wire="topk", layerwise=True)
