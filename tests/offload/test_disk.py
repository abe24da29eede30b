"""DiskTier: offloaded CPU tensors leave memory once written, and come back intact."""
from __future__ import annotations

import os
import weakref

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_mpi.offload.disk import DiskTier
from lightning_mpi.offload.session import OffloadSession
from lightning_mpi.offload.tensors import layout_of


@pytest.mark.timeout(30)
def test_offloaded_tensors_leave_memory_during_forward(tmp_path, tiers):
    """What lowers peak RSS: an offloaded activation's memory is freed once it is written,
    before backward starts. Storage weak references see exactly when memory goes."""

    def forward(hooks):
        x = torch.randn(4096, requires_grad=True)
        storages = []
        with hooks:
            h = x
            for _ in range(8):
                h = (h * 0.5).exp()
                storages.append(weakref.ref(h.untyped_storage()))
            loss = h.sum()
        return loss, storages

    loss, storages = forward(saved_tensors_hooks(lambda t: t.detach(), lambda t: t))
    assert sum(s() is not None for s in storages) == 8  # without offload autograd keeps them all
    tier = DiskTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=1024, keep_last=1, prefetch=2)
    session.start(set())
    loss, storages = forward(saved_tensors_hooks(session.pack, session.unpack))
    tier._io.submit(lambda: None).result()  # let the queued writes finish
    assert [s() is not None for s in storages] == [False] * 7 + [True]  # only the kept-last one
    loss.backward()
    session.finish()


@pytest.mark.timeout(30)
def test_swap_out_fetch_take_round_trip_through_an_unlinked_file(tmp_path, tiers):
    tier = DiskTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    tensors = [torch.randn(1000), torch.randn(30, 40).t(), torch.arange(5000, dtype=torch.int16)]
    tickets = [tier.swap_out(t, layout_of(t), t._version) for t in tensors]
    assert os.listdir(tmp_path) == []  # unlinked at once: the space lives with the descriptor
    tier.fetch(tickets[2])
    tier.fetch(tickets[2])  # idempotent
    back = [tier.take(ticket) for ticket in reversed(tickets)][::-1]
    for t, b in zip(tensors, back):
        assert torch.equal(t, b) and t.stride() == b.stride() and t.dtype == b.dtype
    discarded = tier.swap_out(tensors[0], layout_of(tensors[0]), tensors[0]._version)
    tier.discard(discarded)
    with pytest.raises(RuntimeError, match="already taken or discarded"):
        tier.take(discarded)
    stats = tier.end_step()
    assert stats.files == 1 and stats.file_bytes >= sum(t.numel() * t.element_size() for t in tensors)
