"""Wire formats for the exchange: fp32 (identity), fp16, bf16, int8, int4 and one bit per value.

A codec turns rows of fp32 values into rows of wire words and back. Encoding writes into a
preallocated wire buffer so that the hot path allocates nothing. Every codec works row-wise on a
``[rows, chunk]`` view: ASA sends row ``j`` to rank ``j``, and each row carries what is needed to
decode it on its own.

16-bit wire rows start with one ``int16`` header word holding a power-of-two exponent ``e``: the
row is sent as ``half(x * 2**e)`` and decoded as ``float(w) * 2**-e``. ``e`` puts the row's largest
magnitude just below ``2**14``, which prevents fp16 overflow and keeps small gradients out of the
subnormal range. Scaling by a power of two is exact, so it adds no rounding of its own. The wire
is sent as raw 16-bit words (an ``int16`` view): mpi4py only maps a float16 type when the MPI
library has one, and the sum happens in fp32 on the receiver anyway.

The lossy 8-bit and 1-bit rows are ``uint8`` words with an 8-byte header (two raw 32-bit words),
padded to a multiple of 4 bytes so the header of every row can be read as ``int32``/``float32``:

- :class:`Int8Codec`: per-row min-max quantization onto 256 levels of a power-of-two step
  ``2**s`` whose grid contains 0 (header: ``m = floor(min / 2**s)`` and ``s``); value
  ``(m + q) * 2**s``. A power-of-two step costs at most one bit against an arbitrary step and
  buys exact arithmetic: encode and decode are exact, and ``x - decode(encode(x))`` is exactly
  representable, so error feedback conserves mass to the last bit. It also allows rounding by
  adding ``2**23`` (see the class), so encoding is three vectorised passes after the min/max.
- :class:`Int4Codec`: the same grid with 16 levels, two values packed per byte (low nibble
  first); as exact as int8, at half its bytes (Streaming DiLoCo's 4-bit outer gradients).
- :class:`OneBitCodec`: one sign bit per value and two scales per block of 128 values (the mean
  of the non-negative values and the mean magnitude of the negative ones, as in Seide et al.'s
  1-bit SGD, whose scales are per column), rounded to 8 significant bits: 1.5 bits per value.
  Bits are packed by a 64-bit multiply, unpacked by a table.

Every codec runs as a handful of whole-tensor torch ops on ``[rows, chunk]`` views, with scratch
buffers allocated once per shape; per-row quantities are ``[rows, 1]`` tensors (no Python loop
over rows, no ``.item()``). Avoided on purpose, because they measured an order of magnitude slower
on CPU than the plain ops used instead: ``torch.aminmax`` (``amin`` + ``amax``), ``torch.where``
with broadcast operands (a lookup table), ``addcmul`` with two broadcast operands (``mul`` then
``add_``), ``trunc`` and float-to-``uint8`` casts (the ``2**23`` trick), integer reductions (a
popcount table over packed bytes), and, in :mod:`~lightning_mpi.comm.collectives`, ``torch.sum`` over
a short leading dimension (row adds). ``benchmarks/codec_speed.py`` times all of it.

On CUDA tensors, when cupy is installed, the heavy passes of fp16, int8 (with its error-feedback
residual) and 1-bit encoding run as fused kernels instead (:mod:`lightning_mpi.comm.cupy_kernels`),
bit-exact against the torch code here; CPU tensors always take the torch code.

Top-k sparsification is not row-wise (it chooses entries across the whole buffer): see
:mod:`lightning_mpi.comm.sparse`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from lightning_mpi.comm.buffers import scratch_buffer
from lightning_mpi.comm.cupy_kernels import kernels_for

#: Largest magnitude a scaled fp16 row may reach: 2**14 leaves a factor 4 to fp16's 65504.
_TARGET_EXPONENT = 14


def cuda_kernels(t: Tensor):
    """The fused cupy kernels for a CUDA tensor (None on CPU, without cupy, or when switched off)."""
    if not t.is_cuda:
        return None
    return kernels_for(t)


@dataclass(frozen=True)
class Codec:
    """Base wire format: fp32 identity. Stateless; subclasses change the wire dtype and scaling."""

    name: str = "fp32"
    #: element dtype of the wire buffer as MPI sees it
    wire_dtype: ClassVar[torch.dtype] = torch.float32
    #: whether decode(encode(x)) may differ from x
    lossy: ClassVar[bool] = False

    def wire_numel(self, chunk: int) -> int:
        """Wire words for one row of ``chunk`` values."""
        return chunk

    def encode(self, src: Tensor, dst: Tensor) -> None:
        """Write ``src`` (``[rows, chunk]`` float) into ``dst`` (``[rows, wire_numel(chunk)]``)."""
        dst.copy_(src)

    def decode(self, src: Tensor, dst: Tensor) -> None:
        """Write the decoded rows of ``src`` into float ``dst`` (``[rows, chunk]``)."""
        dst.copy_(src)

    def encode_decoded(self, src: Tensor, dst: Tensor, decoded: Tensor) -> None:
        """:meth:`encode` ``src`` into ``dst`` and leave ``decode(dst)`` in ``decoded`` (``[rows,
        chunk]`` float, not ``src``): what the receivers will see, for error feedback. Here the two
        calls; a codec that can take the decoded values from its own encoding overrides it."""
        self.encode(src, dst)
        self.decode(dst, decoded)


@dataclass(frozen=True)
class HalfCodec(Codec):
    """fp16 or bf16 on the wire, one ``int16`` exponent header per row (see module docstring)."""

    name: str = "fp16"
    half_dtype: torch.dtype = torch.float16
    scaled: bool = True
    wire_dtype: ClassVar[torch.dtype] = torch.int16
    lossy: ClassVar[bool] = True

    def wire_numel(self, chunk: int) -> int:
        return chunk + 1

    def _exponents(self, src: Tensor) -> Tensor:
        """Per-row exponent ``e`` with ``max|row| * 2**e < 2**14``; 0 for all-zero or non-finite rows."""
        # amax and amin are vectorised reductions; abs() would first write a full-size copy.
        return self._exponents_from(src.amax(dim=1), src.amin(dim=1))

    @staticmethod
    def _exponents_from(hi: Tensor, lo: Tensor) -> Tensor:
        """:meth:`_exponents` from the rows' maxima and minima (``[rows]``)."""
        peak = torch.maximum(hi, lo.neg())
        _, exp = torch.frexp(peak)  # peak = m * 2**exp with 0.5 <= m < 1, so peak < 2**exp
        e = (_TARGET_EXPONENT - exp).clamp_(-120, 120)
        return torch.where(torch.isfinite(peak) & (peak > 0), e, torch.zeros_like(e))

    def encode(self, src: Tensor, dst: Tensor) -> None:
        if self.scaled and src.is_cuda and self.half_dtype == torch.float16:
            kernels = cuda_kernels(src)
            if kernels is not None and kernels.half_encode(self, src, dst):
                return
        values = dst[:, 1:].view(self.half_dtype)
        if self.scaled:
            e = self._exponents(src)
            dst[:, 0].copy_(e)
            # Scale in fp32, then cast: torch's mixed-dtype ``mul(out=half)`` is an order of
            # magnitude slower than a same-dtype multiply followed by a plain cast.
            scaled = _scratch(src)
            torch.mul(src, torch.exp2(e.to(src.dtype)).unsqueeze(1), out=scaled)
            values.copy_(scaled)
        else:
            dst[:, 0].zero_()
            values.copy_(src)

    def decode(self, src: Tensor, dst: Tensor) -> None:
        values = src[:, 1:].view(self.half_dtype)
        dst.copy_(values)
        if self.scaled:
            dst.mul_(torch.exp2(-src[:, 0].to(dst.dtype)).unsqueeze(1))


def _scratch(like: Tensor) -> Tensor:
    """A float buffer shaped like ``like``, allocated once per shape and reused (hot path)."""
    return scratch_buffer("float", tuple(like.shape), like.dtype, like.device)


def _ceil4(n: int) -> int:
    return -(-n // 4) * 4


#: ``s`` header value of a row that held inf or NaN: it decodes to NaN, so the step is skipped.
_NONFINITE = 2**30
#: ``2**23 + q`` for an integer ``0 <= q < 2**22`` is a float32 whose low mantissa bits are ``q``.
_MAGIC = float(2**23)


@dataclass(frozen=True)
class Int8Codec(Codec):
    """Per-row min-max 8-bit quantization on a power-of-two grid (see module docstring).

    Wire row: ``int32 m, int32 s, uint8 q[chunk]`` padded to 4 bytes; value ``(m + q) * 2**s``.
    ``s`` is the smallest exponent with ``(max - min) / 2**s < 254`` and at least
    ``exponent(max|x|) - 22`` (so ``m``, ``m + q`` and ``2**23 - m`` stay exact in fp32; a row whose
    values are all equal uses ``exponent(max|x|) - 24`` instead, which holds its value exactly). A
    row holding inf or NaN decodes to NaN.

    Encoding is three vectorised passes: ``t = x * 2**-s`` (exact), ``t += 2**23 - m`` (rounds to
    the nearest integer, ties to even: ``t = 2**23 + q``), and the int32 bits of ``t`` cast to
    ``uint8`` (their low byte is ``q``). No float-to-int conversion, no clamp: ``0 <= q <= 255``
    holds by the choice of ``s`` and ``m``.
    """

    name: str = "int8"
    wire_dtype: ClassVar[torch.dtype] = torch.uint8
    lossy: ClassVar[bool] = True
    #: ``s`` makes the row's span less than this many grid steps, so that ``q <= levels - 1``
    span_steps: ClassVar[float] = 254.0

    def wire_numel(self, chunk: int) -> int:
        return 8 + _ceil4(chunk)

    def _grid(self, src: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per-row header words ``m``, ``s`` and the encoding's ``2**-s`` and ``2**23 - m`` (``[rows, 1]``)."""
        # amin + amax: two vectorised reductions (torch.aminmax is an order of magnitude slower on CPU).
        return self._grid_from(src.amin(dim=1, keepdim=True), src.amax(dim=1, keepdim=True))

    def _grid_from(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`_grid` from the rows' minima and maxima (``[rows, 1]``)."""
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        zero = torch.zeros_like(lo)
        lo = torch.where(finite, lo, zero)
        hi = torch.where(finite, hi, zero)
        span = hi - lo
        _, e_span = torch.frexp(span / self.span_steps)  # span / span_steps < 2**e_span
        _, e_peak = torch.frexp(torch.maximum(lo.abs(), hi.abs()))
        varying = span > 0
        s = torch.where(varying, torch.maximum(e_span, e_peak - 22), e_peak - 24).clamp_(-126, 127)
        inv = torch.exp2(s.neg().to(torch.float32))
        m = torch.floor(lo * inv)
        # Constant rows send q = 0 (x * 0 + 2**23); their value is m * 2**s exactly.
        inv = torch.where(varying, inv, zero)
        offset = torch.where(varying, m, zero).neg_().add_(_MAGIC)
        return m, torch.where(finite, s, torch.full_like(s, _NONFINITE)), inv, offset

    @staticmethod
    def _scale_of(s: Tensor) -> Tensor:
        """``2**s`` per row from the header's ``s``; NaN for a non-finite row's marker."""
        scale = torch.exp2(s.clamp(-126, 127).to(torch.float32))
        return torch.where(s == _NONFINITE, torch.full_like(scale, float("nan")), scale)

    def encode(self, src: Tensor, dst: Tensor) -> None:
        if src.is_cuda and type(self) is Int8Codec:
            kernels = cuda_kernels(src)
            if kernels is not None and kernels.int8_encode(self, src, dst):
                return
        self._encode_into(src, dst, None)

    def encode_decoded(self, src: Tensor, dst: Tensor, decoded: Tensor) -> None:
        """Encode, with the decoded rows taken from the encoding's own rounded values instead of
        read back from the wire: ``t = 2**23 + q`` is computed in ``decoded``, then ``(t - 2**23 +
        m) · 2**s`` there, the same exact operations as :meth:`decode` on the same ``q`` (so the
        same bits), one pass where decoding the wire takes two or four."""
        if decoded.dtype != torch.float32:  # the 2**23 trick rounds in float32 only
            super().encode_decoded(src, dst, decoded)
            return
        self._encode_into(src, dst, decoded)

    def _encode_into(self, src: Tensor, dst: Tensor, decoded: Tensor | None) -> None:
        """Encode ``src`` into ``dst``, rounding in ``decoded`` (left decoded) or in scratch."""
        rows, chunk = src.shape
        if src.dtype != torch.float32:  # float64 buckets: quantize their float32 rounding
            src = src.to(torch.float32)
        header = dst[:, :8].view(torch.int32)
        m, s, inv, offset = self._grid(src)
        t = _scratch(src) if decoded is None else decoded
        torch.mul(src, inv, out=t)
        t.add_(offset)  # 2**23 + round(x * 2**-s - m): one rounding, ties to even
        # Non-finite rows give NaN bits here: harmless, their header decodes the row to NaN.
        self._write_levels(t, dst)
        header[:, 0:1].copy_(m)
        header[:, 1:2].copy_(s)
        if decoded is not None:  # t - 2**23 = q exactly; q + m exact; times a power of two
            decoded.sub_(_MAGIC).add_(m).mul_(self._scale_of(s))

    def _write_levels(self, t: Tensor, dst: Tensor) -> None:
        """Write the levels ``q`` held in ``t = 2**23 + q`` (``[rows, chunk]``) after the header."""
        chunk = t.shape[1]
        dst[:, 8 : 8 + chunk].copy_(t.view(torch.int32))  # int32 -> uint8 keeps the low byte: q
        if dst.shape[1] > 8 + chunk:
            dst[:, 8 + chunk :].zero_()

    def decode(self, src: Tensor, dst: Tensor) -> None:
        chunk = dst.shape[1]
        header = src[:, :8].view(torch.int32)
        m = header[:, 0:1].to(torch.float32)
        scale = self._scale_of(header[:, 1:2])
        dst.copy_(src[:, 8 : 8 + chunk])  # uint8 -> float: one vectorised pass
        dst.add_(m).mul_(scale)  # q + m is exact (|m| < 2**24), the power-of-two scale too


@dataclass(frozen=True)
class Int4Codec(Int8Codec):
    """Per-row min-max 4-bit quantization on :class:`Int8Codec`'s power-of-two grid, 16 levels.

    Wire row: ``int32 m, int32 s, uint8 packed[ceil(chunk / 2)]`` padded to 4 bytes; value
    ``(m + q) * 2**s``, with ``q`` of entry ``2k`` in the low nibble of byte ``k`` and ``q`` of
    entry ``2k + 1`` in its high nibble. ``s`` makes the span less than 14 steps, so
    ``0 <= q <= 15``. Everything int8 guarantees (exact decode arithmetic, exact error-feedback
    residuals, NaN for a non-finite row) holds here too; only the grid is 16x coarser.
    """

    name: str = "int4"
    span_steps: ClassVar[float] = 14.0

    def wire_numel(self, chunk: int) -> int:
        return 8 + _ceil4(-(-chunk // 2))

    def _write_levels(self, t: Tensor, dst: Tensor) -> None:
        """Pack the levels ``q`` held in ``t = 2**23 + q`` two per byte, low nibble first."""
        rows, chunk = t.shape
        nbytes = -(-chunk // 2)
        q = scratch_buffer("int4.q", (rows, 2 * nbytes), torch.uint8, t.device)
        q[:, :chunk].copy_(t.view(torch.int32))  # the low byte of the bits: q in 0..15
        if chunk % 2:
            q[:, chunk:].zero_()
        pairs = q.view(rows, nbytes, 2)
        packed = dst[:, 8 : 8 + nbytes]
        torch.bitwise_left_shift(pairs[:, :, 1], 4, out=packed)
        packed.bitwise_or_(pairs[:, :, 0])
        if dst.shape[1] > 8 + nbytes:
            dst[:, 8 + nbytes :].zero_()

    def decode(self, src: Tensor, dst: Tensor) -> None:
        rows, chunk = dst.shape
        nbytes = -(-chunk // 2)
        header = src[:, :8].view(torch.int32)
        m = header[:, 0:1].to(torch.float32)
        scale = self._scale_of(header[:, 1:2])
        packed = src[:, 8 : 8 + nbytes]
        q = scratch_buffer("int4.unpacked", (rows, nbytes, 2), torch.uint8, src.device)
        torch.bitwise_and(packed, 0x0F, out=q[:, :, 0])
        torch.bitwise_right_shift(packed, 4, out=q[:, :, 1])
        dst.copy_(q.view(rows, 2 * nbytes)[:, :chunk])
        dst.add_(m).mul_(scale)


#: MSB-first bit packing of 8 bytes that are each 0 or 1: ``(v * _PACK) >> 56`` puts byte i
#: (little-endian order) at bit 7 - i of the top byte; the partial products never carry into it.
_PACK = 0x8040201008040201 - 2**64
_TABLES: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _bit_floats(device: torch.device) -> Tensor:
    """``[256, 8]`` float32: the bits of each byte as 0 or 1, MSB first."""
    return _bit_tables(device)[0].to(torch.float32)


def _bit_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """``[256, 8]`` bool: the bits of each byte, MSB first; ``[256]`` float: their popcounts."""
    tables = _TABLES.get(device)
    if tables is None:
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int64)
        bits = (torch.arange(256).unsqueeze(1) & weights).ne(0)
        tables = _TABLES[device] = (bits.to(device), bits.sum(dim=1).to(torch.float32).to(device))
    return tables


@dataclass(frozen=True)
class OneBitCodec(Codec):
    """Signs as bits with two scales per block of ``block`` values (see module docstring).

    Wire row: one record per block of ``block`` values (the last one of a row may be shorter):
    ``float32 pos, float32 neg, uint8 bits[block / 8]``, MSB first; a set bit (value >= 0) decodes
    to ``pos``, a clear one to ``-neg``. A block holding inf or NaN decodes to NaN. ``block=None``:
    one record per row (its whole chunk, padded to 4 bytes).

    Bits are packed eight at a time with one 64-bit multiply, and unpacked by a table lookup that
    maps each byte straight to its eight decoded floats (a ``[records * 256, 8]`` table built per call).
    """

    name: str = "onebit"
    #: values per pair of scales (a multiple of 32, so that every record stays 4-byte aligned)
    block: int | None = None
    wire_dtype: ClassVar[torch.dtype] = torch.uint8
    lossy: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.block is not None and (self.block < 32 or self.block % 32):
            raise ValueError(f"block={self.block!r}: a 1-bit block must be a multiple of 32 values")

    def _blocks(self, chunk: int) -> tuple[int, int]:
        """(records per row, values per record) for a row of ``chunk`` values."""
        if self.block is None or chunk <= self.block:
            return 1, chunk
        return -(-chunk // self.block), self.block

    def wire_numel(self, chunk: int) -> int:
        blocks, size = self._blocks(chunk)
        return blocks * (8 + _ceil4(-(-size // 8)))

    @staticmethod
    def _round8(x: Tensor) -> Tensor:
        # 8 significant bits (bf16's mantissa): residuals x - scale then stay on coarse grids.
        return x.to(torch.bfloat16).to(torch.float32)

    def encode(self, src: Tensor, dst: Tensor) -> None:
        rows, chunk = src.shape
        blocks, size = self._blocks(chunk)
        if blocks == 1:
            self._encode_records(src, dst, None)
            return
        padded = blocks * size
        if padded != chunk:  # the last block of each row is short: zeros after it, not counted
            x = scratch_buffer("onebit.padded", (rows, padded), src.dtype, src.device)
            x[:, :chunk].copy_(src)
            x[:, chunk:].zero_()
            short = torch.zeros(rows, blocks, dtype=torch.float32, device=src.device)
            short[:, -1] = padded - chunk
            self._encode_records(x.view(rows * blocks, size), dst.view(rows * blocks, -1), short.view(-1))
        else:
            self._encode_records(src.reshape(rows * blocks, size), dst.view(rows * blocks, -1), None)

    def _encode_records(self, src: Tensor, dst: Tensor, short: Tensor | None) -> None:
        """Encode each row of ``src`` as one record of ``dst``; ``short``: per row, the zeros padded
        at its end (counted neither as non-negative nor as negative values)."""
        rows, chunk = src.shape
        nbytes = -(-chunk // 8)
        header = dst[:, :8].view(torch.float32)
        # Sums of the non-negative and of the negative values: max(x, 0), then x - max(x, 0).
        t = _scratch(src)
        torch.clamp(src, min=0, out=t)
        pos_sum = t.sum(dim=1)
        torch.sub(src, t, out=t)
        neg_sum = t.sum(dim=1)
        # The sign bits and their count per row: a warp ballot on CUDA with cupy, torch otherwise.
        kernels = cuda_kernels(src)
        npos = None if kernels is None else kernels.onebit_pack(src, dst)
        if npos is None:
            npos = self._pack_signs(src, dst)
        if short is not None:
            npos = npos - short
        nneg = chunk - npos if short is None else chunk - short - npos
        pos = pos_sum / npos.clamp(min=1)
        neg = -neg_sum / nneg.clamp(min=1)
        bad = ~(torch.isfinite(pos_sum) & torch.isfinite(neg_sum))  # inf or NaN anywhere in the row
        nan = torch.full_like(pos, float("nan"))
        header[:, 0].copy_(torch.where(bad, nan, self._round8(pos)))
        header[:, 1].copy_(torch.where(bad, nan, self._round8(neg)))
        if dst.shape[1] > 8 + nbytes:
            dst[:, 8 + nbytes :].zero_()

    @staticmethod
    def _pack_signs(src: Tensor, dst: Tensor) -> Tensor:
        """Write the sign bits of ``src`` into ``dst[:, 8 : 8 + nbytes]``; return the ``[rows]``
        float32 count of values >= 0 (the torch path of the 1-bit packing)."""
        rows, chunk = src.shape
        nbytes = -(-chunk // 8)
        # One byte per value (1: x >= 0), zero-padded to whole bytes, packed 8 to a 64-bit word.
        flags = scratch_buffer("onebit.flags", (rows, nbytes * 8), torch.bool, src.device)
        torch.ge(src, 0, out=flags[:, :chunk])
        if chunk % 8:  # shared with other chunk sizes of the same byte count: clear the padding
            flags[:, chunk:].zero_()
        words = scratch_buffer("onebit.words", (rows, nbytes), torch.int64, src.device)
        torch.mul(flags.view(torch.uint8).view(torch.int64), _PACK, out=words)
        words.bitwise_right_shift_(56).bitwise_and_(0xFF)
        dst[:, 8 : 8 + nbytes].copy_(words)
        # Count the set bits with a 256-entry popcount table over the packed bytes.
        _, popcount = _bit_tables(src.device)
        index = scratch_buffer("onebit.index", (rows, nbytes), torch.int32, src.device)
        index.copy_(words)
        counts = scratch_buffer("onebit.counts", (rows * nbytes,), torch.float32, src.device)
        torch.index_select(popcount, 0, index.view(-1), out=counts)
        return counts.view(rows, nbytes).sum(dim=1)

    def decode(self, src: Tensor, dst: Tensor) -> None:
        rows, chunk = dst.shape
        blocks, size = self._blocks(chunk)
        if blocks == 1:
            self._decode_records(src, dst)
            return
        # Many records: a per-record table (8 KiB each) would cost more than the values; the bits
        # as 0/1 floats instead, times each record's scales (exact: 0·x and 1·x are).
        records = src.reshape(rows * blocks, -1)
        header = records[:, :8].view(torch.float32)
        nbytes = size // 8
        index = scratch_buffer("onebit.index", (rows * blocks, nbytes), torch.int32, src.device)
        index.copy_(records[:, 8 : 8 + nbytes])
        ones = scratch_buffer("onebit.ones", (rows, blocks * size), torch.float32, src.device)
        torch.index_select(_bit_floats(src.device), 0, index.view(-1), out=ones.view(-1, 8))
        flat = ones.view(rows * blocks, size)
        zeros = scratch_buffer("onebit.zeros", (rows, blocks * size), torch.float32, src.device)
        torch.sub(1.0, flat, out=zeros.view(rows * blocks, size))
        zeros.view(rows * blocks, size).mul_(header[:, 1:2])
        flat.mul_(header[:, 0:1]).sub_(zeros.view(rows * blocks, size))
        dst.copy_(ones[:, :chunk])

    def _decode_records(self, src: Tensor, dst: Tensor) -> None:
        """Decode each record (row) of ``src`` into the row of ``dst``."""
        rows, chunk = dst.shape
        nbytes = -(-chunk // 8)
        header = src[:, :8].view(torch.float32)
        bits, _ = _bit_tables(src.device)
        # table[r * 256 + b] holds the 8 values that byte b decodes to in row r.
        table = torch.where(bits, header[:, 0:1, None], header[:, 1:2, None].neg()).to(dst.dtype).view(rows * 256, 8)
        index = scratch_buffer("onebit.index", (rows, nbytes), torch.int32, src.device)
        index.copy_(src[:, 8 : 8 + nbytes])
        if rows > 1:
            index.add_(torch.arange(0, rows * 256, 256, dtype=torch.int32, device=src.device).unsqueeze(1))
        if chunk % 8 == 0 and dst.is_contiguous():
            torch.index_select(table, 0, index.view(-1), out=dst.view(rows * nbytes, 8))
        else:
            out = scratch_buffer("onebit.decoded", (rows, nbytes * 8), dst.dtype, src.device)
            torch.index_select(table, 0, index.view(-1), out=out.view(rows * nbytes, 8))
            dst.copy_(out[:, :chunk])


FP32 = Codec()
FP16 = HalfCodec(name="fp16", half_dtype=torch.float16, scaled=True)
# bf16 has fp32's exponent range: scaling cannot overflow or underflow it, so skip that pass.
BF16 = HalfCodec(name="bf16", half_dtype=torch.bfloat16, scaled=False)

INT8 = Int8Codec()
INT4 = Int4Codec()
# 128 values per pair of scales: an ASA row is a whole chunk of a bucket, several layers of very
# different magnitudes, and one pair of scales for it sent a small layer at a large one's magnitude
# (error feedback then held it back for many steps). Chosen on tuning seeds 3-5 of
# benchmarks/compression.py --families (held-out 0-2 in docs/convergence.md), against mpi_asa:
# whole rows -16.3 / -55.0 points (MLP / CNN, SGD) and -10.2% (LM, AdamW); blocks of 1024:
# -5.8 / -25.7 / -8.3; 256: -3.6 / -3.6 / -7.6; 128: +0.7 / -0.8 / -6.5; 64: +0.2 / -0.4 / -5.9;
# bits per value (one bit, and 64 per block for its two scales): 1.06, 1.25, 1.5 and 2.
ONEBIT = OneBitCodec(block=128)

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16, INT8, INT4, ONEBIT)}


def get_codec(name: str) -> Codec:
    """Look a codec up by name; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"wire={name!r} is not a known wire format; choose one of {sorted(CODECS)}") from None
