"""Byte-level views of tensors, for moving saved activations out of the device and back.

A tensor travels as its raw bytes plus a :class:`Layout`. Tensors that are dense in memory (any
permutation of a contiguous tensor: channels-last, transposes) keep their strides, so backward
kernels see exactly the layout they would have seen without offloading; that is what makes the
weights bitwise identical. Other tensors (strided slices) travel as a contiguous copy; the
offload session keeps those resident instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """What is needed to rebuild a tensor from its bytes."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``numel`` consecutive elements of its storage, in some
    order of its dimensions (no gaps, no overlaps)."""
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1), key=lambda p: p[1]
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def layout_of(t: torch.Tensor) -> Layout:
    nbytes = t.numel() * t.element_size()
    if is_dense(t):
        stride = tuple(t.stride())
    else:  # travels as a contiguous copy
        stride = _contiguous_strides(tuple(t.shape))
    return Layout(tuple(t.shape), stride, t.dtype, t.device, nbytes)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` tensor holding ``t``'s elements in the order :func:`from_bytes` expects.
    A view of ``t``'s memory when ``t`` is dense (it shares ``t``'s version counter), else a
    contiguous copy."""
    t = t.detach()
    if is_dense(t):
        flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
    else:
        flat = t.contiguous().view(-1)
    return flat.view(torch.uint8)


def from_bytes(buf: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Rebuild a tensor from the first ``layout.nbytes`` bytes of the ``uint8`` tensor ``buf``
    (a view, no copy)."""
    return buf[: layout.nbytes].view(layout.dtype).as_strided(layout.shape, layout.stride)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
