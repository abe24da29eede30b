"""DiskTier: offloaded CPU tensors leave memory once written, and come back intact."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_mpi.offload.disk import DiskTier
from lightning_mpi.offload.session import OffloadSession


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
