"""Wire formats in one process: round trips on odd sizes, error bounds, error-feedback bookkeeping."""
import math

import pytest
import torch

from lightning_mpi.comm.codecs import BF16, CODECS, FP16, FP32, INT8, ONEBIT, get_codec
from lightning_mpi.comm.collectives import encode_with_feedback_
from lightning_mpi.comm.sparse import pack_pairs, scatter_pairs_, topk_count, topk_select

ODD = [(1, 1), (1, 3), (3, 7), (2, 13), (5, 1001)]
ROW_CODECS = [FP32, FP16, BF16, INT8, ONEBIT]


def round_trip(codec, x):
    wire = torch.empty(x.shape[0], codec.wire_numel(x.shape[1]), dtype=codec.wire_dtype)
    codec.encode(x, wire)
    out = torch.empty_like(x)
    codec.decode(wire, out)
    return out, wire


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ODD, ids=str)
@pytest.mark.parametrize("codec", ROW_CODECS, ids=lambda c: c.name)
def test_row_codecs_round_trip_odd_sizes(codec, shape):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    out, _ = round_trip(codec, x)
    if codec is FP32:
        assert torch.equal(out, x)
    elif codec in (FP16, BF16):
        assert torch.allclose(out, x, rtol=1e-2, atol=0)
    elif codec is INT8:
        # Power-of-two step of at most 2 * range / 254, half a step of error at most.
        step = 2 * (x.amax(dim=1) - x.amin(dim=1)).clamp(min=1e-30) / 254
        assert ((out - x).abs() <= step.unsqueeze(1) / 2 + 1e-7).all()
    else:  # one bit: signs kept; each block of a row decodes to two values, the means of each sign (8 bits)
        assert torch.equal(out >= 0, x >= 0)
        for row, dec in zip(x, out):
            for start in range(0, row.numel(), ONEBIT.block):
                block, decoded = row[start : start + ONEBIT.block], dec[start : start + ONEBIT.block]
                for sign in (block >= 0, block < 0):
                    if sign.any():
                        mean = float(block[sign].mean())
                        assert math.isclose(float(decoded[sign][0]), mean, rel_tol=2**-8, abs_tol=1e-30)
                assert decoded.unique().numel() <= 2


@pytest.mark.timeout(60)
def test_onebit_scales_each_block_on_its_own():
    """A row that spans tensors of very different magnitudes (a bucket holds several layers): each
    block of ``block`` values gets its own two scales, so a small layer is not sent at a large one's
    magnitude; a short last block counts only its own values."""
    from lightning_mpi.comm.codecs import OneBitCodec

    block = ONEBIT.block
    x = torch.cat([torch.full((block,), 100.0), torch.full((block,), 2.0**-7), torch.full((5,), -0.5)]).unsqueeze(0)
    out, wire = round_trip(ONEBIT, x)
    assert out[0, :block].eq(100.0).all() and out[0, block : 2 * block].eq(2.0**-7).all()
    assert out[0, 2 * block :].eq(-0.5).all()
    assert wire.shape[1] == ONEBIT.wire_numel(x.shape[1]) == 3 * (8 + block // 8)
    whole, _ = round_trip(OneBitCodec(block=None), x)  # one pair of scales per row: the small layer is lost
    assert whole[0, block : 2 * block].eq(whole[0, 0]).all() and whole[0, 0] > 45  # sent at about 50
    with pytest.raises(ValueError, match="block=48"):
        OneBitCodec(block=48)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [INT8, ONEBIT], ids=lambda c: c.name)
def test_compression_factor(codec):
    x = torch.randn(1, 4097)
    out, wire = round_trip(codec, x)
    bytes_fp32 = x.numel() * 4
    factor = bytes_fp32 / (wire.numel() * wire.element_size())
    assert factor >= (3.9 if codec is INT8 else 20)  # one bit, and two float32 scales per block of 128
    assert out.shape == x.shape


@pytest.mark.timeout(60)
def test_int8_is_exact_on_representable_values():
    x = torch.randint(-100, 100, (3, 11)).float() * 0.25
    out, _ = round_trip(INT8, x)
    assert torch.equal(out, x)
    const = torch.full((2, 5), 3.1415926)  # zero range: the value itself must come back
    assert torch.equal(round_trip(INT8, const)[0], const)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [FP16, INT8, ONEBIT], ids=lambda c: c.name)
def test_non_finite_rows_stay_non_finite(codec):
    x = torch.tensor([[1.0, float("inf"), 2.0], [1.0, 2.0, 3.0]])
    out, _ = round_trip(codec, x)
    assert not torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [1, 7, 1001])
@pytest.mark.parametrize("ratio", [1.0, 0.3, 0.01])
def test_topk_round_trip_odd_sizes(numel, ratio):
    torch.manual_seed(1)
    x = torch.randn(numel)
    k = topk_count(numel, ratio)
    wire = torch.empty(2 * k, dtype=torch.int32)  # k indices, then k float32 values as raw words
    pack_pairs(x, topk_select(x, k), wire)
    out = torch.zeros(numel)
    scatter_pairs_(out, wire)
    kept = out != 0
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], x[kept])
    if k < numel:  # what was kept is the largest in magnitude
        assert x[kept].abs().min() >= x[~kept].abs().max()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [INT8, get_codec("int4"), ONEBIT, FP16], ids=lambda c: c.name)
def test_error_feedback_conserves_mass_exactly(codec):
    # Gradients on a dyadic grid: sums stay exact, so any difference is lost mass, not rounding.
    gen = torch.Generator().manual_seed(2)
    rows, cols = 3, 37
    residual = torch.zeros(rows, cols)
    scratch = torch.empty(rows, cols)
    wire = torch.empty(rows, codec.wire_numel(cols), dtype=codec.wire_dtype)
    sent = torch.zeros(rows, cols, dtype=torch.float64)
    given = torch.zeros(rows, cols, dtype=torch.float64)
    decoded = torch.empty(rows, cols)
    for _ in range(200):
        g = torch.randint(-1024, 1025, (rows, cols), generator=gen).float() / 1024
        given += g.double()
        encode_with_feedback_(codec, g, wire, residual, scratch)
        codec.decode(wire, decoded)
        sent += decoded.double()
    assert torch.equal(sent + residual.double(), given)
    assert residual.abs().max() < 4  # feedback keeps the residual bounded


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ODD, ids=str)
@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "onebit"])
def test_encode_decoded_gives_the_bits_that_decoding_the_wire_gives(name, shape):
    # Error feedback takes the decoded rows from the encoding itself; the receivers decode the
    # wire: both must agree to the last bit, or feedback would lose (or invent) mass.
    codec = get_codec(name)
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen) * torch.logspace(-8, 8, shape[0]).unsqueeze(1)
    if shape[0] >= 3:
        x[1] = -3.5  # a constant row: its value travels in the header
        x[2, -1] = float("nan")  # a non-finite row decodes to NaN
    wire = torch.empty(shape[0], codec.wire_numel(shape[1]), dtype=codec.wire_dtype)
    decoded = torch.full(shape, 7.0)
    codec.encode_decoded(x, wire, decoded)
    want_wire = torch.empty_like(wire)
    codec.encode(x, want_wire)
    want = torch.empty(shape)
    codec.decode(want_wire, want)
    assert torch.equal(wire, want_wire)
    assert torch.equal(decoded.isnan(), want.isnan())
    assert torch.equal(decoded.nan_to_num(), want.nan_to_num())
    wide = torch.empty(shape, dtype=torch.float64)  # a float64 bucket's scratch: decoded from the wire
    codec.encode_decoded(x, wire, wide)
    assert torch.equal(wide.isnan(), want.isnan()) and torch.equal(wide.nan_to_num(), want.double().nan_to_num())


@pytest.mark.timeout(60)
def test_codec_table():
    assert {"fp32", "fp16", "bf16", "int8", "onebit"} <= set(CODECS)
    assert get_codec("int8") is INT8
    with pytest.raises(ValueError, match="wire"):
        get_codec("int3")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ratio", [0.01, 0.2])
def test_topk_select_threshold_path_is_exact(ratio):
    # Large enough for the sampled-threshold path: the same magnitudes as torch.topk, k distinct
    # indices, in ascending order.
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(3))
    k = topk_count(x.numel(), ratio)
    index = topk_select(x, k)
    assert index.numel() == k and bool((index[1:] > index[:-1]).all())
    want = torch.topk(x.abs(), k).values
    assert torch.equal(torch.sort(x[index].abs()).values, torch.sort(want).values)


@pytest.mark.timeout(60)
def test_topk_select_ties_and_fallback():
    from lightning_mpi.comm import sparse

    n = 400_000
    x = torch.zeros(n)
    x[::7] = 1.0
    x[::5] = 2.0  # ties at the k-th magnitude: the lowest indices among them are taken
    k = 100_000  # all 80,000 twos, then the first 20,000 of the ones
    index = sparse.topk_select(x, k)
    assert index.numel() == k and index.unique().numel() == k
    assert int((x[index] == 2.0).sum()) == n // 5
    assert torch.equal(index[x[index] == 1.0], (x == 1.0).nonzero().view(-1)[:20_000])
    # A sample that overestimates the threshold (its entries are the only large ones) leaves
    # fewer candidates than k: the full torch.topk answers instead, still exactly.
    y = torch.randn(n, generator=torch.Generator().manual_seed(4))
    y[sparse._sample_index(n, y.device)[:500]] = 100.0
    k = topk_count(n, 0.01)
    index = sparse.topk_select(y, k)
    assert torch.equal(torch.sort(y[index].abs()).values, torch.sort(torch.topk(y.abs(), k).values).values)


@pytest.mark.timeout(60)
def test_int8_constant_and_near_constant_rows():
    # Constant rows (any sign, any mantissa) come back exactly; rows whose range is tiny next
    # to their magnitude are quantized on a grid of at most 2**(exponent(max) - 22).
    const = torch.tensor([[-3.1415926] * 5, [1e-30] * 5, [7.0e20] * 5, [0.0] * 5])
    assert torch.equal(round_trip(INT8, const)[0], const)
    gen = torch.Generator().manual_seed(5)
    near = 1000.0 + torch.randn(3, 101, generator=gen) * 1e-3
    near[1] = -near[1]
    out, _ = round_trip(INT8, near)
    _, e_peak = torch.frexp(near.abs().amax(dim=1, keepdim=True))
    assert ((out - near).abs() <= torch.exp2(e_peak.float() - 23)).all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", [INT8, ONEBIT], ids=lambda c: c.name)
def test_float64_buffers(codec):
    x = torch.randn(2, 19, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    wire = torch.empty(2, codec.wire_numel(19), dtype=codec.wire_dtype)
    codec.encode(x, wire)
    out = torch.empty_like(x)
    codec.decode(wire, out)
    want = torch.empty(2, 19)
    codec.decode(wire, want)
    assert torch.equal(out, want.double())
    assert torch.equal(out >= 0, x >= 0) if codec is ONEBIT else (out - x).abs().max() < 0.05


@pytest.mark.timeout(60)
def test_onebit_chunks_sharing_a_byte_count():
    # 15 and 13 values both pack into 2 bytes: scratch shared between them must not leak bits.
    x15 = torch.ones(1, 15)
    x13 = -torch.ones(1, 13)
    round_trip(ONEBIT, x15)
    out, wire = round_trip(ONEBIT, x13)
    assert torch.equal(out, x13)
    assert wire[0, 8:10].tolist() == [0, 0]
