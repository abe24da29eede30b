"""Wire formats for the exchange: fp32 (identity), fp16 and bf16.

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
        peak = src.abs().amax(dim=1)
        _, exp = torch.frexp(peak)  # peak = m * 2**exp with 0.5 <= m < 1, so peak < 2**exp
        e = (_TARGET_EXPONENT - exp).clamp_(-120, 120)
        return torch.where(torch.isfinite(peak) & (peak > 0), e, torch.zeros_like(e))

    def encode(self, src: Tensor, dst: Tensor) -> None:
        values = dst[:, 1:].view(self.half_dtype)
        if self.scaled:
            e = self._exponents(src)
            dst[:, 0].copy_(e)
            torch.mul(src, torch.exp2(e.to(src.dtype)).unsqueeze(1), out=values)
        else:
            dst[:, 0].zero_()
            values.copy_(src)

    def decode(self, src: Tensor, dst: Tensor) -> None:
        values = src[:, 1:].view(self.half_dtype)
        if self.scaled:
            scale = torch.exp2(-src[:, 0].to(dst.dtype)).unsqueeze(1)
            torch.mul(values, scale, out=dst)
        else:
            dst.copy_(values)


FP32 = Codec()
FP16 = HalfCodec(name="fp16", half_dtype=torch.float16, scaled=True)
# bf16 has fp32's exponent range: scaling cannot overflow or underflow it, so skip that pass.
BF16 = HalfCodec(name="bf16", half_dtype=torch.bfloat16, scaled=False)

CODECS: dict[str, Codec] = {c.name: c for c in (FP32, FP16, BF16)}


def get_codec(name: str) -> Codec:
    """Look a codec up by name; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"wire={name!r} is not a known wire format; choose one of {sorted(CODECS)}") from None
