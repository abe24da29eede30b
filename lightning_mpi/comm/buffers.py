"""Buffers allocated once and reused every step: buckets of parameters, and scratch space.

A bucket flattens tensors into one contiguous buffer whose length is a multiple of the world size.
``pack`` copies the members' gradients (or values) in, ``unpack`` copies the exchanged result back
out. The tail that pads the buffer to a multiple of ``world_size`` is zero and stays zero: summing
zeros keeps it zero, so ASA can cut the buffer into ``world_size`` equal chunks whatever the
parameter shapes.

:func:`scratch_buffer` is the hot path's working space (the codecs and their CUDA kernels):
uninitialised tensors kept per (tag, shape, dtype, device), so a step allocates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def padded_numel(numel: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that holds ``numel`` elements (0 stays 0)."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be >= 1")
    return -(-numel // multiple) * multiple


_SCRATCH: dict[tuple, Tensor] = {}


def scratch_buffer(tag: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised buffer allocated once per (tag, shape, dtype, device) and reused (hot path).

    Callers of one tag share it, so none may rely on what another left in it."""
    key = (tag, tuple(shape), dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """Exchange dtype for a parameter dtype: float64 stays float64, everything else sums in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Bucket:
    """A group of same-device tensors that share one padded flat buffer.

    ``tensors`` are the members (parameters), ``offsets`` their start inside ``flat``. ``numel`` is
    the number of real elements; ``flat.numel()`` is that padded to a multiple of the world size.
    """

    tensors: list[Tensor]
    offsets: list[int]
    numel: int
    flat: Tensor
    index: int = 0
    _views: list[Tensor] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._views = [self.flat[o : o + t.numel()].view_as(t) for t, o in zip(self.tensors, self.offsets, strict=True)]

    def views(self) -> list[Tensor]:
        """Views into ``flat`` shaped like each member; writing them writes the buffer."""
        return self._views

    def pack_grads(self) -> None:
        """Copy every member's ``.grad`` into the buffer; a missing gradient contributes zeros."""
        for tensor, view in zip(self.tensors, self._views, strict=True):
            if tensor.grad is None:
                view.zero_()
            else:
                view.copy_(tensor.grad)

    def unpack_grads(self) -> None:
        """Copy the buffer back into every member's ``.grad`` (allocating it if it was ``None``)."""
        for tensor, view in zip(self.tensors, self._views, strict=True):
            if tensor.grad is None:
                tensor.grad = view.detach().to(tensor.dtype, copy=True)
            else:
                tensor.grad.copy_(view)

    def pack(self, tensors: Sequence[Tensor] | None = None) -> None:
        """Copy member values (or the given same-shaped tensors) into the buffer."""
        for tensor, view in zip(tensors if tensors is not None else self.tensors, self._views, strict=True):
            view.copy_(tensor.detach())

    def unpack(self, tensors: Sequence[Tensor] | None = None) -> None:
        """Copy the buffer into member values (or the given same-shaped tensors)."""
        with torch.no_grad():
            for tensor, view in zip(tensors if tensors is not None else self.tensors, self._views, strict=True):
                tensor.copy_(view)


def make_buckets(
    tensors: Iterable[Tensor],
    world_size: int,
    bucket_bytes: int | None = None,
    reverse: bool = True,
    first_bucket_bytes: int | None = None,
) -> list[Bucket]:
    """Group ``tensors`` into padded buckets of about ``bucket_bytes`` each.

    A bucket is closed as soon as it holds ``bucket_bytes`` or more (the first one of each group:
    ``first_bucket_bytes``, when given), so it may exceed the cap by its last tensor. That is
    DDP's rule, and it matters for overlap: in reverse registration order a layer's bias comes
    right before its weight and both gradients are ready at the same moment. Closing a bucket
    *before* a tensor that would overflow it leaves the next layer's bias at its end, and the
    bucket then waits for that layer's backward; closing it once full ends it on a whole layer.
    A small first bucket starts the exchange after the last layer or two instead of a third of
    the way through backward.

    Tensors are grouped by device and exchange dtype, so a model spread over mixed devices gets
    one bucket list per device. ``reverse=True`` fills buckets from the last tensor to the first:
    backward produces gradients in roughly that order, so the first bucket fills first.
    ``bucket_bytes=None`` puts each device/dtype group into one bucket.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    for name, value in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value!r} must be >= 1 or None")
    ordered = list(tensors)
    if reverse:
        ordered.reverse()
    groups: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    open_bytes: dict[tuple[torch.device, torch.dtype], int] = {}  # bytes in the group's open bucket
    for tensor in ordered:
        key = (tensor.device, buffer_dtype(tensor.dtype))
        runs = groups.setdefault(key, [])
        if key not in open_bytes:  # the last bucket is full (or there is none yet): open one
            runs.append([])
            open_bytes[key] = 0
        runs[-1].append(tensor)
        open_bytes[key] += tensor.numel() * torch.empty((), dtype=key[1]).element_size()
        cap = first_bucket_bytes if len(runs) == 1 and first_bucket_bytes is not None else bucket_bytes
        if cap is not None and open_bytes[key] >= cap:
            del open_bytes[key]
    buckets: list[Bucket] = []
    for (device, dtype), runs in groups.items():
        for members in runs:
            offsets, total = [], 0
            for tensor in members:
                offsets.append(total)
                total += tensor.numel()
            flat = torch.zeros(padded_numel(total, world_size), dtype=dtype, device=device)
            buckets.append(Bucket(members, offsets, total, flat, index=len(buckets)))
    return buckets
