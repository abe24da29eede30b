"""Fused CUDA kernels (cupy) for the codecs' heavy passes on device tensors; torch stays the fallback.

Used by :mod:`~lightning_mpi.comm.codecs` and :func:`~lightning_mpi.comm.collectives.encode_with_feedback_`
only for CUDA tensors, and only when cupy imports (``pip install "lightning_mpi[cuda]"``) and
``LIGHTNING_MPI_CUPY`` is not ``0``. CPU tensors never reach this module, so the CPU path is
unchanged. Three kernels replace several whole-tensor torch passes each:

- **fp16 scale-and-cast** (:class:`~lightning_mpi.comm.codecs.HalfCodec`): per-row min/max in one
  pass, then ``half(x * 2**e)`` in one pass.
- **int8 with the error-feedback residual fused in** (:class:`~lightning_mpi.comm.codecs.Int8Codec`):
  ``a = rows + residual`` and the per-row min/max in one pass; then quantize, write the wire
  bytes, decode and update the residual in one pass.
- **1-bit sign packing** (:class:`~lightning_mpi.comm.codecs.OneBitCodec`): a warp ballot packs
  32 signs, MSB first per byte, and counts the set bits per row.

The contract is **bit-exact equality with the torch path on the same device** (tests in
``tests/comm/test_cupy_kernels.py``, run on a GPU by ``benchmarks/gpu_check.py``). It holds by
construction, not by tolerance:

- every per-row quantity (exponents, grids, scales) is computed by the codec's own torch code on
  ``[rows]`` tensors; only the elementwise passes run here;
- min and max do not depend on summation order, so partial min/max per block reduced by torch's
  ``amin``/``amax`` equal the whole-row reductions (a block that saw inf or NaN reports NaN, which
  the codecs' non-finite rule then sees as torch's own reductions would show it);
- the elementwise arithmetic is PTX ``mul.rn``/``add.rn``/``sub.rn``/``min``/``max`` without
  ``.ftz``, never contracted into an FMA, in the order torch performs the same operations, and the
  fp32->fp16 cast is ``cvt.rn.f16.f32``, the instruction torch's cast uses. Written in PTX because
  cupy appends ``-ftz=true`` to NVRTC's options, which would flush subnormals where torch keeps
  them;
- sums over a row (1-bit's scales) stay in torch: a kernel would add in another order.

Zero-copy: the kernels take torch's device pointers (``data_ptr``), launch on torch's current
stream of the tensor's device, and their scratch comes from torch's caching allocator, so cupy's
own memory pool is never used. A call that does not fit the kernels (not float32, a row stride
that is not contiguous within the row, misaligned headers) returns ``False``/``None`` and the
caller runs torch's code.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import scratch_buffer

#: ``LIGHTNING_MPI_CUPY=0`` keeps the torch path on CUDA (debugging, or timing torch against cupy).
ENV_SWITCH = "LIGHTNING_MPI_CUPY"

#: Values each block of the row-wise passes handles (256 threads x 16 values).
_TILE = 4096
_THREADS = 256

_SOURCE = r"""
#define F32_NAN __int_as_float(0x7fc00000)
#define F32_INF __int_as_float(0x7f800000)

__device__ __forceinline__ bool finite32(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// cupy compiles with -ftz=true after the caller's options (cupy issue #9576), and under it the
// intrinsics, fminf/fmaxf and comparisons flush subnormals to zero; torch's kernels keep them. So
// every float operation here is written in PTX without .ftz, and the sign test on the bits.
#define PTX_F32_BINARY(name, instruction)                                   \
    __device__ __forceinline__ float name(float a, float b) {               \
        float r;                                                            \
        asm(instruction " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));         \
        return r;                                                           \
    }

PTX_F32_BINARY(mul_rn, "mul.rn.f32")
PTX_F32_BINARY(add_rn, "add.rn.f32")
PTX_F32_BINARY(sub_rn, "sub.rn.f32")
// min/max as fminf/fmaxf (a NaN operand gives the other), subnormals kept
PTX_F32_BINARY(min_f32, "min.f32")
PTX_F32_BINARY(max_f32, "max.f32")

// v >= 0 as IEEE says (torch's test): +0, -0, positive values and +inf; not NaN, not negatives
__device__ __forceinline__ bool nonnegative(float v) {
    const unsigned int u = __float_as_uint(v);
    return u <= 0x7f800000u || u == 0x80000000u;
}

__device__ __forceinline__ unsigned short f32_to_f16_rn(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}

// Pass 1 of fp16 and int8: optionally rows += residual (written back), then each block's min and
// max of its tile of one row; NaN for both when the tile held inf or NaN.
// grid (blocks per row, rows), block 256 threads.
extern "C" __global__ void row_minmax(
    float* rows, const float* residual, long long rows_stride, long long res_stride,
    long long chunk, long long tile, float* part_lo, float* part_hi, long long nblk)
{
    const long long r = blockIdx.y, b = blockIdx.x;
    float* x = rows + r * rows_stride;
    const float* res = residual ? residual + r * res_stride : 0;
    const long long start = b * tile;
    const long long end = min(start + tile, chunk);
    float lo = F32_INF, hi = -F32_INF;
    int bad = 0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float v = x[i];
        if (res) { v = add_rn(v, res[i]); x[i] = v; }
        bad |= !finite32(v);
        lo = min_f32(lo, v);
        hi = max_f32(hi, v);
    }
    for (int o = 16; o > 0; o >>= 1) {
        lo = min_f32(lo, __shfl_down_sync(0xffffffffu, lo, o));
        hi = max_f32(hi, __shfl_down_sync(0xffffffffu, hi, o));
        bad |= __shfl_down_sync(0xffffffffu, bad, o);
    }
    __shared__ float s_lo[32], s_hi[32];
    __shared__ int s_bad[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    if (lane == 0) { s_lo[warp] = lo; s_hi[warp] = hi; s_bad[warp] = bad; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nwarps; ++w) {
            lo = min_f32(lo, s_lo[w]); hi = max_f32(hi, s_hi[w]); bad |= s_bad[w];
        }
        part_lo[r * nblk + b] = bad ? F32_NAN : lo;
        part_hi[r * nblk + b] = bad ? F32_NAN : hi;
    }
}

// Pass 2 of fp16: wire[r, 1 + i] = half(x[r, i] * scale[r]) (the header word is written by torch).
extern "C" __global__ void half_scale_cast(
    const float* x, long long x_stride, unsigned short* wire, long long wire_stride,
    long long chunk, long long tile, const float* scale)
{
    const long long r = blockIdx.y;
    const long long start = (long long)blockIdx.x * tile;
    const long long end = min(start + tile, chunk);
    const float s = scale[r];
    const float* row = x + r * x_stride;
    unsigned short* out = wire + r * wire_stride + 1;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        out[i] = f32_to_f16_rn(mul_rn(row[i], s));
    }
}

// Pass 2 of int8: t = a * inv + offset (two roundings, as torch's mul then add_), q = low byte of
// t's bits; with a residual, decoded = (q + m) * scale and residual = a - decoded.
extern "C" __global__ void int8_quantize(
    const float* a, long long a_stride, unsigned char* wire, long long wire_stride,
    float* residual, long long res_stride, float* decoded, long long dec_stride,
    long long chunk, long long tile,
    const float* inv, const float* offset, const float* m, const float* scale)
{
    const long long r = blockIdx.y;
    const long long start = (long long)blockIdx.x * tile;
    const long long end = min(start + tile, chunk);
    const float iv = inv[r], off = offset[r];
    const float* row = a + r * a_stride;
    unsigned char* q = wire + r * wire_stride + 8;
    float* res = residual ? residual + r * res_stride : 0;
    float* dec = decoded ? decoded + r * dec_stride : 0;
    const float mm = res ? m[r] : 0.0f, sc = res ? scale[r] : 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float v = row[i];
        const float t = add_rn(mul_rn(v, iv), off);
        const unsigned char qb = (unsigned char)(__float_as_uint(t) & 0xffu);
        q[i] = qb;
        if (res) {
            const float d = mul_rn(add_rn((float)qb, mm), sc);
            dec[i] = d;
            res[i] = sub_rn(v, d);
        }
    }
}

// 1-bit: bit 7 - j of byte k is (x[8k + j] >= 0); counts[r] += set bits. One warp packs 32 values
// (4 bytes) with a ballot; grid (ceil(chunk / 256), rows), block 256 threads.
extern "C" __global__ void onebit_pack(
    const float* x, long long x_stride, unsigned char* wire, long long wire_stride,
    long long chunk, long long nbytes, int* counts)
{
    const long long r = blockIdx.y;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool flag = i < chunk && nonnegative(x[r * x_stride + i]);
    const unsigned int bits = __ballot_sync(0xffffffffu, flag);
    const int lane = threadIdx.x & 31;
    if (lane < 4) {
        const long long byte = (i - lane) / 8 + lane;
        if (byte < nbytes) {
            wire[r * wire_stride + 8 + byte] = (unsigned char)((__brev(bits) >> (24 - 8 * lane)) & 0xffu);
        }
    }
    if (lane == 0) {
        const int c = __popc(bits);
        if (c) atomicAdd(counts + r, c);
    }
}
"""

_LOCK = threading.Lock()
_STATE: dict[Any, Any] = {}


def enabled() -> bool:
    """Whether the switch allows the kernels (``LIGHTNING_MPI_CUPY`` unset or not ``0``)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def cupy_module() -> Any | None:
    """cupy, or None when it does not import (checked once)."""
    if "cupy" not in _STATE:
        with _LOCK:
            if "cupy" not in _STATE:
                try:
                    import cupy  # type: ignore[import-not-found]  # optional: the [cuda] extra
                except Exception as error:  # ImportError, or a cupy built for another CUDA
                    _STATE["cupy"], _STATE["why"] = None, f"{type(error).__name__}: {error}"
                else:
                    _STATE["cupy"], _STATE["why"] = cupy, None
    return _STATE["cupy"]


def kernels_for(t: Tensor) -> Kernels | None:
    """The kernels for ``t``'s device, or None: a CPU tensor, cupy missing, or switched off."""
    if not t.is_cuda or not enabled():
        return None
    cupy = cupy_module()
    if cupy is None:
        return None
    device = t.device.index if t.device.index is not None else torch.cuda.current_device()
    key = ("kernels", device)
    kernels = _STATE.get(key)
    if kernels is None:
        with _LOCK:
            kernels = _STATE.get(key)
            if kernels is None:
                try:
                    kernels = Kernels(cupy, device)
                except Exception as error:  # a compiler or driver that cannot build them: torch's path
                    kernels = False
                    _STATE["why"] = f"cupy kernels not built on cuda:{device}: {type(error).__name__}: {error}"
                    warnings.warn(
                        f"lightning_mpi: {_STATE['why']}; the codecs use torch's code", RuntimeWarning, stacklevel=3
                    )
                _STATE[key] = kernels
    return kernels if isinstance(kernels, Kernels) else None  # False: they could not be built here


def total_launches() -> int:
    """Kernel launches so far in this process, all devices together (0 without cupy)."""
    return sum(sum(k.launches.values()) for key, k in list(_STATE.items()) if isinstance(key, tuple) and k)


def why_not() -> str | None:
    """Why the kernels are not in use (cupy's import error or the build error), if known."""
    return _STATE.get("why")


def _rows_ok(*tensors: Tensor) -> bool:
    """2-D, contiguous within each row (any row stride), on one device."""
    device = tensors[0].device
    return all(t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1) and t.device == device for t in tensors)


class Kernels:
    """The compiled kernels of one device and the launches that use them (see module docstring)."""

    def __init__(self, cupy: Any, device: int) -> None:
        self._cupy, self.device = cupy, device
        with cupy.cuda.Device(device):
            module = cupy.RawModule(code=_SOURCE, options=("--std=c++14", "--fmad=false"))
            self._fn = {
                name: module.get_function(name)
                for name in ("row_minmax", "half_scale_cast", "int8_quantize", "onebit_pack")
            }
        #: kernel launches so far, per kernel name (tests check that the kernels really ran)
        self.launches = dict.fromkeys(self._fn, 0)

    def _launch(self, name: str, grid: tuple[int, int], args: tuple) -> None:
        cupy = self._cupy
        stream = torch.cuda.current_stream(self.device)
        with cupy.cuda.Device(self.device), cupy.cuda.ExternalStream(stream.cuda_stream):
            self._fn[name]((grid[0], grid[1], 1), (_THREADS, 1, 1), args)
        self.launches[name] += 1

    def _row_minmax(self, rows: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """Per-row ``[rows, 1]`` min and max of ``rows`` (after ``rows += residual``); NaN for both
        in a row that holds inf or NaN."""
        n, chunk = rows.shape
        nblk = -(-chunk // _TILE)
        lo = scratch_buffer("cupy.lo", (n, nblk), torch.float32, rows.device)
        hi = scratch_buffer("cupy.hi", (n, nblk), torch.float32, rows.device)
        res_ptr, res_stride = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        self._launch(
            "row_minmax",
            (nblk, n),
            (rows.data_ptr(), res_ptr, rows.stride(0), res_stride, chunk, _TILE, lo.data_ptr(), hi.data_ptr(), nblk),
        )
        return lo.amin(dim=1, keepdim=True), hi.amax(dim=1, keepdim=True)

    # --- fp16 ---------------------------------------------------------------------------------------
    def half_encode(self, codec: Any, src: Tensor, dst: Tensor) -> bool:
        """:meth:`HalfCodec.encode` for scaled fp16; False when the call does not fit the kernels."""
        n, chunk = src.shape
        if (
            src.dtype != torch.float32
            or dst.dtype != torch.int16
            or chunk == 0
            or not _rows_ok(src, dst)
            or dst.shape[1] != chunk + 1
        ):
            return False
        lo, hi = self._row_minmax(src, None)
        e = codec._exponents_from(hi.squeeze(1), lo.squeeze(1))
        dst[:, 0].copy_(e)
        scale = torch.exp2(e.to(src.dtype)).contiguous()
        self._launch(
            "half_scale_cast",
            (-(-chunk // _TILE), n),
            (src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), chunk, _TILE, scale.data_ptr()),
        )
        return True

    # --- int8 ---------------------------------------------------------------------------------------
    def int8_encode(
        self, codec: Any, src: Tensor, dst: Tensor, residual: Tensor | None = None, decoded: Tensor | None = None
    ) -> bool:
        """:meth:`Int8Codec.encode` of ``src``; with ``residual`` (and ``decoded``, the caller's
        scratch) also ``encode_with_feedback_``: ``src += residual`` first, then ``decoded`` gets
        the decoded wire and ``residual = src - decoded``. False when the call does not fit."""
        n, chunk = src.shape
        tensors = [src, dst] + ([] if residual is None or decoded is None else [residual, decoded])
        if (
            src.dtype != torch.float32
            or chunk == 0
            or dst.dtype != torch.uint8
            or not _rows_ok(*tensors)
            or dst.stride(0) % 4
            or dst.data_ptr() % 4
            or dst.shape[1] < 8 + chunk
        ):
            return False
        if residual is not None and (
            decoded is None
            or residual.dtype != torch.float32
            or decoded.dtype != torch.float32
            or residual.shape != src.shape
            or decoded.shape != src.shape
        ):
            return False
        lo, hi = self._row_minmax(src, residual)
        m, s, inv, offset = codec._grid_from(lo, hi)
        header = dst[:, :8].view(torch.int32)
        header[:, 0:1].copy_(m)
        header[:, 1:2].copy_(s)
        if dst.shape[1] > 8 + chunk:
            dst[:, 8 + chunk :].zero_()
        # What Int8Codec.decode reads back from the header words (m through int32, as it does).
        m_dec = header[:, 0:1].to(torch.float32).contiguous()
        scale = codec._scale_of(header[:, 1:2]).contiguous() if residual is not None else inv
        res_ptr, res_stride = (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        dec_ptr, dec_stride = (0, 0) if residual is None or decoded is None else (decoded.data_ptr(), decoded.stride(0))
        inv, offset = inv.contiguous(), offset.contiguous()
        self._launch(
            "int8_quantize",
            (-(-chunk // _TILE), n),
            (
                src.data_ptr(),
                src.stride(0),
                dst.data_ptr(),
                dst.stride(0),
                res_ptr,
                res_stride,
                dec_ptr,
                dec_stride,
                chunk,
                _TILE,
                inv.data_ptr(),
                offset.data_ptr(),
                m_dec.data_ptr(),
                scale.data_ptr(),
            ),
        )
        return True

    # --- 1-bit --------------------------------------------------------------------------------------
    def onebit_pack(self, src: Tensor, dst: Tensor) -> Tensor | None:
        """Pack the signs of ``src`` (``[rows, chunk]`` float32) into ``dst[:, 8 : 8 + ceil(chunk / 8)]``
        (MSB first); returns the float32 ``[rows]`` count of values >= 0, or None when the call
        does not fit the kernels."""
        n, chunk = src.shape
        nbytes = -(-chunk // 8)
        if (
            src.dtype != torch.float32
            or chunk == 0
            or dst.dtype != torch.uint8
            or not _rows_ok(src, dst)
            or dst.shape[1] < 8 + nbytes
        ):
            return None
        counts = scratch_buffer("cupy.counts", (n,), torch.int32, src.device)
        counts.zero_()
        self._launch(
            "onebit_pack",
            (-(-chunk // _THREADS), n),
            (src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0), chunk, nbytes, counts.data_ptr()),
        )
        return counts.to(torch.float32)
