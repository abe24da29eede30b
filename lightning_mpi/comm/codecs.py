"""Wire formats for the exchange: fp32 (identity), fp16, bf16, int8 and one bit per value.

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
  representable, so error feedback conserves mass to the last bit.
- :class:`OneBitCodec`: one sign bit per value and two per-row scales (the mean of the
  non-negative values and the mean magnitude of the negative ones, as in Seide et al.'s 1-bit
  SGD), rounded to 8 significant bits.

Top-k sparsification is not row-wise (it chooses entries across the whole buffer): see
:mod:`lightning_mpi.comm.sparse`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Largest magnitude a scaled fp16 row may reach: 2**14 leaves a factor 4 to fp16's 65504.
_TARGET_EXPONENT = 14


@dataclass(frozen=True)
class Codec:
    """Base wire format: fp32 identity. Stateless; subclasses change the wire dtype and scaling."""

    name: str = "fp32"

    @property
    def wire_dtype(self) -> torch.dtype:
        """Element dtype of the wire buffer as MPI sees it."""
        return torch.float32

    @property
    def lossy(self) -> bool:
        return False

    def wire_numel(self, chunk: int) -> int:
        """Wire words for one row of ``chunk`` values."""
        return chunk

    def encode(self, src: Tensor, dst: Tensor) -> None:
        """Write ``src`` (``[rows, chunk]`` float) into ``dst`` (``[rows, wire_numel(chunk)]``)."""
        dst.copy_(src)

    def decode(self, src: Tensor, dst: Tensor) -> None:
        """Write the decoded rows of ``src`` into float ``dst`` (``[rows, chunk]``)."""
        dst.copy_(src)

    def compress(self, tensor: Tensor) -> tuple[Tensor, tuple]:
        """Stateless convenience (Horovod-style): one row in, ``(wire, ctx)`` out."""
        flat = tensor.detach().reshape(1, -1).float()
        wire = torch.empty(1, self.wire_numel(flat.shape[1]), dtype=self.wire_dtype, device=tensor.device)
        self.encode(flat, wire)
        return wire, (tensor.shape, tensor.dtype)

    def decompress(self, wire: Tensor, ctx: tuple) -> Tensor:
        shape, dtype = ctx
        out = torch.empty(1, int(torch.Size(shape).numel()), dtype=torch.float32, device=wire.device)
        self.decode(wire, out)
        return out.reshape(shape).to(dtype)


@dataclass(frozen=True)
class HalfCodec(Codec):
    """fp16 or bf16 on the wire, one ``int16`` exponent header per row (see module docstring)."""

    name: str = "fp16"
    half_dtype: torch.dtype = torch.float16
    scaled: bool = True

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.int16

    @property
    def lossy(self) -> bool:
        return True

    def wire_numel(self, chunk: int) -> int:
        return chunk + 1

    def _exponents(self, src: Tensor) -> Tensor:
        """Per-row exponent ``e`` with ``max|row| * 2**e < 2**14``; 0 for all-zero or non-finite rows."""
        # amax and amin are vectorised reductions; abs() would first write a full-size copy.
        peak = torch.maximum(src.amax(dim=1), src.amin(dim=1).neg())
        _, exp = torch.frexp(peak)  # peak = m * 2**exp with 0.5 <= m < 1, so peak < 2**exp
        e = (_TARGET_EXPONENT - exp).clamp_(-120, 120)
        return torch.where(torch.isfinite(peak) & (peak > 0), e, torch.zeros_like(e))

    def encode(self, src: Tensor, dst: Tensor) -> None:
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


_SCRATCH: dict[tuple, Tensor] = {}


def _scratch(like: Tensor) -> Tensor:
    """A float buffer shaped like ``like``, allocated once per shape and reused (hot path)."""
    key = (tuple(like.shape), like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty_like(like)
    return buf


def _ceil4(n: int) -> int:
    return -(-n // 4) * 4


#: ``s`` header value of a row that held inf or NaN: it decodes to NaN, so the step is skipped.
_NONFINITE = 2**30


@dataclass(frozen=True)
class Int8Codec(Codec):
    """Per-row min-max 8-bit quantization on a power-of-two grid (see module docstring).

    Wire row: ``int32 m, int32 s, uint8 q[chunk]`` padded to 4 bytes; value ``(m + q) * 2**s``.
    ``s`` is the smallest exponent with ``(max - min) / 2**s < 254`` and at least
    ``exponent(max|x|) - 24`` (so ``m`` and ``m + q`` stay exact in fp32). A row holding inf or NaN
    decodes to NaN.
    """

    name: str = "int8"

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def lossy(self) -> bool:
        return True

    def wire_numel(self, chunk: int) -> int:
        return 8 + _ceil4(chunk)

    def encode(self, src: Tensor, dst: Tensor) -> None:
        chunk = src.shape[1]
        header = dst[:, :8].view(torch.int32)
        lo, hi = src.amin(dim=1), src.amax(dim=1)
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        lo = torch.where(finite, lo, torch.zeros_like(lo))
        hi = torch.where(finite, hi, torch.zeros_like(hi))
        span = hi - lo
        _, e_span = torch.frexp(span / 254.0)  # span / 254 < 2**e_span
        _, e_peak = torch.frexp(torch.maximum(lo.abs(), hi.abs()))
        e_span = torch.where(span > 0, e_span, torch.full_like(e_span, -1000))
        s = torch.maximum(e_span, e_peak - 24).clamp_(-126, 127)
        inv = torch.exp2(-s.to(torch.float32)).unsqueeze(1)
        m = torch.floor(lo.unsqueeze(1) * inv)
        q = torch.round(src * inv).sub_(m).clamp_(0, 255)
        q = torch.where(finite.unsqueeze(1), q, torch.zeros_like(q))
        dst[:, 8 : 8 + chunk].copy_(q)
        dst[:, 8 + chunk :].zero_()
        header[:, 0].copy_(m.squeeze(1))
        header[:, 1].copy_(torch.where(finite, s, torch.full_like(s, _NONFINITE)))

    def decode(self, src: Tensor, dst: Tensor) -> None:
        chunk = dst.shape[1]
        header = src[:, :8].view(torch.int32)
        m = header[:, 0].to(torch.float32).unsqueeze(1)
        s = header[:, 1]
        scale = torch.exp2(s.clamp(-126, 127).to(torch.float32))
        scale = torch.where(s == _NONFINITE, torch.full_like(scale, float("nan")), scale).unsqueeze(1)
        torch.add(src[:, 8 : 8 + chunk].to(torch.float32), m, out=dst)
        dst.mul_(scale)


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


@dataclass(frozen=True)
class OneBitCodec(Codec):
    """Signs as bits with two per-row scales (see module docstring).

    Wire row: ``float32 pos, float32 neg, uint8 bits[ceil(chunk / 8)]`` padded to 4 bytes; a set
    bit (value >= 0) decodes to ``pos``, a clear one to ``-neg``. Non-finite rows decode to NaN.
    """

    name: str = "onebit"

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def lossy(self) -> bool:
        return True

    def wire_numel(self, chunk: int) -> int:
        return 8 + _ceil4(-(-chunk // 8))

    @staticmethod
    def _round8(x: Tensor) -> Tensor:
        # 8 significant bits (bf16's mantissa): residuals x - scale then stay on coarse grids.
        return x.to(torch.bfloat16).to(torch.float32)

    def encode(self, src: Tensor, dst: Tensor) -> None:
        rows, chunk = src.shape
        nbytes = -(-chunk // 8)
        header = dst[:, :8].view(torch.float32)
        positive = src >= 0
        npos = positive.sum(dim=1)
        pos_sum = torch.where(positive, src, torch.zeros_like(src)).sum(dim=1)
        neg_sum = torch.where(positive, torch.zeros_like(src), src).sum(dim=1)
        pos = pos_sum / npos.clamp(min=1)
        neg = -neg_sum / (chunk - npos).clamp(min=1)
        bad = ~torch.isfinite(src.sum(dim=1))  # NaN compares False and would vanish into `neg`
        nan = torch.full_like(pos, float("nan"))
        header[:, 0].copy_(torch.where(bad, nan, self._round8(pos)))
        header[:, 1].copy_(torch.where(bad, nan, self._round8(neg)))
        bits = torch.zeros(rows, nbytes * 8, dtype=torch.uint8, device=src.device)
        bits[:, :chunk] = positive
        packed = (bits.view(rows, nbytes, 8) * _BIT_WEIGHTS.to(src.device)).sum(dim=2, dtype=torch.uint8)
        dst[:, 8 : 8 + nbytes].copy_(packed)
        dst[:, 8 + nbytes :].zero_()

    def decode(self, src: Tensor, dst: Tensor) -> None:
        rows, chunk = dst.shape
        nbytes = -(-chunk // 8)
        header = src[:, :8].view(torch.float32)
        packed = src[:, 8 : 8 + nbytes]
        bits = packed.unsqueeze(2).bitwise_and(_BIT_WEIGHTS.to(src.device)).ne(0).view(rows, nbytes * 8)[:, :chunk]
        torch.where(bits, header[:, 0:1], -header[:, 1:2], out=dst)


FP32 = Codec()
FP16 = HalfCodec(name="fp16", half_dtype=torch.float16, scaled=True)
# bf16 has fp32's exponent range: scaling cannot overflow or underflow it, so skip that pass.
BF16 = HalfCodec(name="bf16", half_dtype=torch.bfloat16, scaled=False)

INT8 = Int8Codec()
ONEBIT = OneBitCodec()

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16, INT8, ONEBIT)}


def get_codec(name: str) -> Codec:
    """Look a codec up by name; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"wire={name!r} is not a known wire format; choose one of {sorted(CODECS)}") from None
