"""The cupy kernels against the torch path on the same GPU: bit for bit (needs CUDA and cupy).

Every case encodes the same rows twice on the device, once with the kernels and once with
``LIGHTNING_MPI_CUPY=0`` (torch's code), and compares every output byte: wire words, headers,
padding, and for error feedback the rows, the decoded scratch and the residual (floats compared
as their int32 bits, so NaN rows count too). Without a GPU these tests are skipped (marker
``cuda``); without cupy they skip with the reason. ``benchmarks/gpu_check.py`` runs them.
"""
from __future__ import annotations

import pytest
import torch

from lightning_mpi.comm import codecs, cupy_kernels
from lightning_mpi.comm.collectives import ASAWorkspace, asa_mean_steps, encode_with_feedback_

pytestmark = pytest.mark.cuda

#: (rows, chunk): one value, odd sizes, one tile, several tiles with a ragged end, one long row;
#: 7 rows hold every special row of :func:`rows_for` (zero, constant, subnormal, inf, NaN).
SHAPES = [(1, 1), (2, 7), (3, 31), (2, 33), (4, 4096), (2, 4097), (3, 10_001), (7, 300), (7, 9_000), (1, 1 << 20)]


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy", reason="cupy not installed: pip install 'lightning_mpi[cuda]'")


@pytest.fixture
def torch_path(monkeypatch):
    """A context that runs its body on torch's code (the kernels switched off)."""

    class TorchPath:
        def __enter__(self):
            monkeypatch.setenv(cupy_kernels.ENV_SWITCH, "0")

        def __exit__(self, *exc):
            monkeypatch.delenv(cupy_kernels.ENV_SWITCH)

    return TorchPath()


def rows_for(rows: int, chunk: int, seed: int) -> torch.Tensor:
    """Rows of many magnitudes, with an all-zero row, a constant row, a subnormal row and rows
    holding inf and NaN when there are enough rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, chunk, generator=g)
    x *= torch.logspace(-30, 20, rows).unsqueeze(1) if rows > 1 else 1e-3
    specials = [lambda r: r.zero_(), lambda r: r.fill_(0.3), lambda r: r.mul_(1e-40),
                lambda r: r.index_fill_(0, torch.tensor([0]), float("inf")), lambda r: r.index_fill_(0, torch.tensor([0]), float("nan"))]
    if rows >= 3:
        for i, special in enumerate(specials[: rows - 2]):
            special(x[i + 1])
    return x.cuda()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.equal(bits(a), bits(b)), f"{what}: {(bits(a) != bits(b)).sum().item()} of {a.numel()} words differ"


def encode_both(codec, src, torch_path):
    """The wire from the kernels and from torch (encode leaves ``src`` as it is; the wires start
    filled with 7s, so padding that is not written shows)."""
    kernel_wire = torch.full((src.shape[0], codec.wire_numel(src.shape[1])), 7, dtype=codec.wire_dtype, device="cuda")
    torch_wire = kernel_wire.clone()
    codec.encode(src, kernel_wire)
    with torch_path:
        codec.encode(src, torch_wire)
    return kernel_wire, torch_wire


def test_kernels_are_found_for_cuda_tensors_only(cupy):
    assert cupy_kernels.kernels_for(torch.zeros(2, device="cuda")) is not None, cupy_kernels.why_not()
    assert cupy_kernels.kernels_for(torch.zeros(2)) is None


@pytest.mark.parametrize("name", ["fp16", "int8", "onebit"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_encode_is_bit_exact_against_torch(cupy, torch_path, name, shape):
    codec = codecs.get_codec(name)
    kernels = cupy_kernels.kernels_for(torch.zeros(1, device="cuda"))
    assert kernels is not None, cupy_kernels.why_not()
    before = sum(kernels.launches.values())
    kernel_wire, torch_wire = encode_both(codec, rows_for(*shape, seed=shape[1]), torch_path)
    assert sum(kernels.launches.values()) > before, "the kernels did not run"
    assert_same_bits(kernel_wire, torch_wire, f"{name} wire {shape}")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_error_feedback_is_bit_exact_against_torch(cupy, torch_path, shape):
    codec = codecs.INT8
    rows = rows_for(*shape, seed=1)
    residual = rows_for(*shape, seed=2) * 1e-3
    outputs = []
    for use_kernels in (True, False):
        r, res = rows.clone(), residual.clone()
        wire = torch.full((shape[0], codec.wire_numel(shape[1])), 7, dtype=torch.uint8, device="cuda")
        scratch = torch.full_like(r, 5.0)
        if use_kernels:
            encode_with_feedback_(codec, r, wire, res, scratch)
        else:
            with torch_path:
                encode_with_feedback_(codec, r, wire, res, scratch)
        outputs.append((r, wire, res, scratch))
    for what, a, b in zip(("rows", "wire", "residual", "decoded"), *outputs):
        assert_same_bits(a, b, f"{what} {shape}")


def test_row_views_with_a_row_stride_and_a_side_stream(cupy, torch_path):
    """Rows sliced out of a wider buffer (as ASA's per-rank blocks are), on a non-default stream."""
    wide = rows_for(4, 9000, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for name in ("fp16", "int8", "onebit"):
            codec = codecs.get_codec(name)
            kernel_wire, torch_wire = encode_both(codec, wide[1:3, :8000], torch_path)
            assert_same_bits(kernel_wire, torch_wire, f"{name} on a side stream")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["fp16", "int8", "onebit"])
def test_asa_exchange_with_feedback_matches_torch_on_one_rank_of_three(cupy, torch_path, name):
    """What one rank does in ``asa_mean_steps`` (loopback transport), kernels against torch."""

    class Loopback:
        size, rank = 3, 1

        def ialltoall(self, send, recv):
            recv.copy_(send)
            return iter(())

        def iallgather(self, send, recv):
            recv.copy_(send.expand_as(recv))
            return iter(())

    codec = codecs.get_codec(name)
    flat0 = rows_for(3, 5000, seed=4).reshape(-1) * 1e-2
    results = []
    for use_kernels in (True, False):
        flat, residual, owner = flat0.clone(), torch.full_like(flat0, 1e-4), torch.full((5000,), 2e-4, device="cuda")
        work = ASAWorkspace.for_buffer(flat, 3, codec)
        if use_kernels:
            list(asa_mean_steps(Loopback(), flat, codec, work, residual, owner))
        else:
            with torch_path:
                list(asa_mean_steps(Loopback(), flat, codec, work, residual, owner))
        results.append((flat, residual, owner))
    for what, a, b in zip(("mean", "residual", "owner residual"), *results):
        assert_same_bits(a, b, f"{name} {what}")


def test_cupy_memory_pool_is_never_used(cupy):
    pool = cupy.get_default_memory_pool()
    before = pool.total_bytes()
    for name in ("fp16", "int8", "onebit"):
        codec = codecs.get_codec(name)
        src = rows_for(2, 50_000, seed=5)
        codec.encode(src, torch.empty(2, codec.wire_numel(50_000), dtype=codec.wire_dtype, device="cuda"))
    torch.cuda.synchronize()
    assert pool.total_bytes() == before
