"""Tensors as bytes plus a layout: dense tensors keep their strides, others travel contiguous."""
from __future__ import annotations

import pytest
import torch

from lightning_mpi.offload.tensors import as_bytes, from_bytes, is_dense, layout_of


def _round_trip(t: torch.Tensor) -> torch.Tensor:
    copy = as_bytes(t).clone()  # the bytes as a tier would keep them, away from t's memory
    return from_bytes(copy, layout_of(t))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4, 5),
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        lambda: torch.randn(6, 7).t(),
        lambda: torch.randn(4, 6)[1:3],  # a dense slice: an offset into a larger storage
    ],
    ids=["contiguous", "channels-last", "transposed", "row-slice"],
)
def test_dense_tensors_come_back_equal_with_their_strides(make):
    t = make()
    assert is_dense(t)
    back = _round_trip(t)
    assert torch.equal(back, t) and back.stride() == t.stride() and back.dtype == t.dtype


@pytest.mark.timeout(30)
def test_a_strided_view_comes_back_equal_and_contiguous():
    t = torch.randn(4, 6)[:, ::2]
    assert not is_dense(t)
    back = _round_trip(t)
    assert torch.equal(back, t) and back.is_contiguous()
