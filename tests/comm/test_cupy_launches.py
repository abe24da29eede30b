"""The cupy kernels' launches, checked on the CPU against torch's codec code (no GPU, no cupy).

:class:`~lightning_mpi.comm.cupy_kernels.Kernels` is given a stand-in for cupy whose "kernels" are
numpy functions that read the very argument tuples the CUDA kernels get (raw pointers, strides,
sizes) and do what the CUDA source does, in float32 with one rounding per operation, as
``__fmul_rn``/``__fadd_rn`` do. CPU tensors' pointers are host pointers, so the stand-ins read and
write the tensors themselves. That checks everything around the CUDA code: argument order, grids,
per-row values, header words, padding, residual and decoded outputs, bit for bit against the torch
path. The CUDA code itself is checked on a GPU by ``test_cupy_kernels.py``.
"""
from __future__ import annotations

import ctypes
import re
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_mpi.comm import codecs, cupy_kernels
from lightning_mpi.comm.collectives import encode_with_feedback_


def view(ptr: int, dtype, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` at host address ``ptr`` (no copy)."""
    ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


def rows_of(ptr, stride, rows, chunk, dtype, skip=0):
    size = np.dtype(dtype).itemsize
    return [view(ptr + size * (r * stride + skip), dtype, chunk) for r in range(rows)]


def row_minmax(grid, args):
    rows_ptr, res_ptr, rows_stride, res_stride, chunk, tile, lo_ptr, hi_ptr, nblk = args
    n = grid[1]
    lo, hi = view(lo_ptr, np.float32, n * nblk), view(hi_ptr, np.float32, n * nblk)
    residuals = rows_of(res_ptr, res_stride, n, chunk, np.float32) if res_ptr else [None] * n
    for r, (x, res) in enumerate(zip(rows_of(rows_ptr, rows_stride, n, chunk, np.float32), residuals)):
        if res is not None:
            x[:] = x + res
        for b in range(nblk):
            seg = x[b * tile : (b + 1) * tile]
            bad = not np.isfinite(seg).all()
            lo[r * nblk + b] = np.nan if bad else seg.min()
            hi[r * nblk + b] = np.nan if bad else seg.max()


def half_scale_cast(grid, args):
    x_ptr, x_stride, wire_ptr, wire_stride, chunk, tile, scale_ptr = args
    scale = view(scale_ptr, np.float32, grid[1])
    outs = rows_of(wire_ptr, wire_stride, grid[1], chunk, np.uint16, skip=1)
    for r, (x, out) in enumerate(zip(rows_of(x_ptr, x_stride, grid[1], chunk, np.float32), outs)):
        out[:] = (x * scale[r]).astype(np.float16).view(np.uint16)  # cvt.rn.f16.f32: nearest, ties to even


def int8_quantize(grid, args):
    a_ptr, a_stride, wire_ptr, wire_stride, res_ptr, res_stride, dec_ptr, dec_stride, chunk, tile, inv_ptr, off_ptr, m_ptr, scale_ptr = args
    n = grid[1]
    inv, off = view(inv_ptr, np.float32, n), view(off_ptr, np.float32, n)
    m, scale = view(m_ptr, np.float32, n), view(scale_ptr, np.float32, n)
    qs = rows_of(wire_ptr, wire_stride, n, chunk, np.uint8, skip=8)
    for r, (a, q) in enumerate(zip(rows_of(a_ptr, a_stride, n, chunk, np.float32), qs)):
        t = (a * inv[r]) + off[r]
        q[:] = (t.view(np.uint32) & 0xFF).astype(np.uint8)
        if res_ptr:
            d = (q.astype(np.float32) + m[r]) * scale[r]
            view(dec_ptr + 4 * r * dec_stride, np.float32, chunk)[:] = d
            view(res_ptr + 4 * r * res_stride, np.float32, chunk)[:] = a - d


def onebit_pack(grid, args):
    x_ptr, x_stride, wire_ptr, wire_stride, chunk, nbytes, counts_ptr = args
    counts = view(counts_ptr, np.int32, grid[1])
    bits = rows_of(wire_ptr, wire_stride, grid[1], nbytes, np.uint8, skip=8)
    for r, (x, out) in enumerate(zip(rows_of(x_ptr, x_stride, grid[1], chunk, np.float32), bits)):
        flags = x >= 0
        out[:] = np.packbits(flags, bitorder="big")
        counts[r] += int(flags.sum())


class FakeCupy:
    """What :class:`Kernels` uses of cupy, with numpy kernels."""

    def __init__(self):
        self.launched: list[tuple[str, tuple]] = []
        self.cuda = SimpleNamespace(Device=lambda device: nullcontext(), ExternalStream=lambda ptr: nullcontext())

    def RawModule(self, code, options):  # noqa: N802 (cupy's name)
        emulators = {f.__name__: f for f in (row_minmax, half_scale_cast, int8_quantize, onebit_pack)}
        assert all(f"__global__ void {name}(" in code for name in emulators)

        def get_function(name):
            def launch(grid, block, args):
                assert block == (256, 1, 1) and grid[2] == 1 and grid[0] >= 1
                self.launched.append((name, grid))
                with np.errstate(all="ignore"):  # inf and NaN rows, as on the GPU
                    emulators[name](grid, args)

            return launch

        return SimpleNamespace(get_function=get_function)


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return cupy_kernels.Kernels(FakeCupy(), device=0)


def rows_for(rows, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, chunk, generator=g) * torch.logspace(-30, 20, rows).unsqueeze(1)
    if rows >= 7:
        x[1].zero_(), x[2].fill_(0.3), x[3].mul_(1e-40)
        x[4, 0], x[5, 3] = float("inf"), float("nan")
    return x


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


SHAPES = [(1, 1), (2, 7), (3, 33), (2, 4097), (7, 9000)]


@pytest.mark.parametrize("name", ["fp16", "int8", "onebit"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_launches_write_what_torch_writes(kernels, monkeypatch, name, shape):
    codec = codecs.get_codec(name)
    wide = rows_for(shape[0] + 1, shape[1] + 5, seed=shape[1])
    src = wide[1:, 2 : 2 + shape[1]]  # rows with a row stride, as ASA's blocks are
    expected = torch.full((shape[0], codec.wire_numel(shape[1])), 7, dtype=codec.wire_dtype)
    got = expected.clone()
    codec.encode(src, expected)
    if name == "onebit":  # the kernel packs the bits inside OneBitCodec.encode; the scales stay torch's
        monkeypatch.setattr(codecs, "cuda_kernels", lambda t: kernels)
        codec.encode(src, got)
    else:
        assert {"fp16": kernels.half_encode, "int8": kernels.int8_encode}[name](codec, src, got)
    assert torch.equal(bits(got), bits(expected))
    assert kernels._cupy.launched, "no kernel was launched"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_int8_feedback_launches_match_torch(kernels, shape):
    codec = codecs.INT8
    rows, residual = rows_for(*shape, seed=1), rows_for(*shape, seed=2) * 1e-3
    outputs = []
    for fused in (True, False):
        r, res = rows.clone(), residual.clone()
        wire = torch.full((shape[0], codec.wire_numel(shape[1])), 7, dtype=torch.uint8)
        scratch = torch.full_like(r, 5.0)
        if fused:
            assert kernels.int8_encode(codec, r, wire, res, scratch)
        else:
            encode_with_feedback_(codec, r, wire, res, scratch)
        outputs.append((r, wire, res, scratch))
    for what, a, b in zip(("rows", "wire", "residual", "decoded"), *outputs):
        assert torch.equal(bits(a), bits(b)), what


def test_calls_that_do_not_fit_are_left_to_torch(kernels):
    src = torch.randn(2, 64)
    wire = torch.empty(2, codecs.INT8.wire_numel(64), dtype=torch.uint8)
    assert not kernels.int8_encode(codecs.INT8, src.double(), wire)  # float64 buckets
    assert not kernels.int8_encode(codecs.INT8, src.t().contiguous().t(), wire)  # column-major rows
    assert not kernels.half_encode(codecs.FP16, torch.randn(2, 0), torch.empty(2, 1, dtype=torch.int16))
    assert kernels.onebit_pack(src.double(), wire) is None
    assert not kernels._cupy.launched


def test_cpu_tensors_never_reach_the_kernels(monkeypatch):
    monkeypatch.setattr(cupy_kernels, "cupy_module", lambda: pytest.fail("cupy looked up for a CPU tensor"))
    assert cupy_kernels.kernels_for(torch.zeros(3)) is None
    assert codecs.cuda_kernels(torch.zeros(3)) is None


def test_kernels_that_cannot_be_built_leave_the_codecs_on_torch(monkeypatch):
    """A compiler or driver that cannot build the kernels: one warning, then torch's path."""
    broken = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: nullcontext()), RawModule=lambda **kw: 1 / 0)
    monkeypatch.setattr(cupy_kernels, "_STATE", {"cupy": broken})
    cuda_tensor = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with pytest.warns(RuntimeWarning, match="ZeroDivisionError"):
        assert cupy_kernels.kernels_for(cuda_tensor) is None
    assert cupy_kernels.kernels_for(cuda_tensor) is None  # decided once
    assert "cuda:0" in cupy_kernels.why_not() and cupy_kernels.total_launches() == 0


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(cupy_kernels.ENV_SWITCH, "0")
    assert not cupy_kernels.enabled()
    monkeypatch.setenv(cupy_kernels.ENV_SWITCH, "1")
    assert cupy_kernels.enabled()


def test_ctypes_views_are_views():
    t = torch.zeros(4)
    view(t.data_ptr(), np.float32, 4)[:] = 1.5
    assert t.tolist() == [1.5] * 4 and ctypes.sizeof(ctypes.c_float) == 4


def test_kernel_source_uses_no_float_operation_that_cupys_ftz_flag_would_flush():
    """cupy compiles with ``-ftz=true`` after our options, and under it CUDA's float intrinsics,
    ``fminf``/``fmaxf`` and float comparisons flush subnormals to zero where torch keeps them (an
    H100 showed it: only the rows of subnormals differed). The kernels must use the PTX helpers."""
    code = re.sub(r"//[^\n]*", "", cupy_kernels._SOURCE)  # the comments may name what is avoided
    flushed = re.findall(r"__f(?:mul|add|sub|div|fma)_r[nzud]\b|\bfminf\b|\bfmaxf\b|[<>]=?\s*-?\d*\.\d*f\b", code)
    assert flushed == []
    for helper in ("mul.rn.f32", "add.rn.f32", "sub.rn.f32", "min.f32", "max.f32"):
        assert helper in code
