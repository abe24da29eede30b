"""The CUDA paths: pinned host tier and the disk tier's staging (skipped without a GPU)."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl

from lightning_mpi.offload import LMSOffload
from tests.offload.helpers import assert_bitwise_equal, fit_unet_cuda, needs_cuda


@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_cuda_weights_bitwise_identical(target, precision, tmp_path):
    reference = fit_unet_cuda(precision=precision)
    kwargs = {"directory": tmp_path} if target == "disk" else {}
    lms = LMSOffload(target=target, min_bytes=4096, keep_last=1, **kwargs)
    assert_bitwise_equal(reference, fit_unet_cuda([lms], precision=precision))
    assert lms.last_stats.offloaded_bytes > 0


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_pinned_pool_does_not_grow():
    lms = LMSOffload(target="cpu", min_bytes=4096, keep_last=0)
    seen = []

    class PoolProbe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(lms._tier.pool.stats().reserved_bytes)

    fit_unet_cuda([lms, PoolProbe()], steps=4)
    assert seen[0] > 0 and seen == [seen[0]] * 4


@needs_cuda
@pytest.mark.timeout(120)
def test_tensors_saved_during_cuda_graph_capture_stay_on_the_device():
    import torch
    from torch import nn
    from torch.autograd.graph import saved_tensors_hooks

    from lightning_mpi.offload.pool import HostBufferPool
    from lightning_mpi.offload.session import OffloadSession
    from lightning_mpi.offload.tiers import CudaHostTier

    lin = nn.Linear(1024, 1024).cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    warmup = torch.cuda.Stream()  # capture wants its kernels warmed up on a side stream
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for _ in range(2):
            lin(x).tanh().sum().backward()
    torch.cuda.current_stream().wait_stream(warmup)
    tier = CudaHostTier(HostBufferPool(pin_memory=True), max_inflight=4)
    session = OffloadSession(tier, lambda t: t.is_cuda, min_bytes=1024, keep_last=0, prefetch=1)
    session.start(set())
    graph = torch.cuda.CUDAGraph()
    with saved_tensors_hooks(session.pack, session.unpack), torch.cuda.graph(graph):
        lin(x).tanh()
    stats = session.finish()
    tier.close()
    assert stats.captured_tensors >= 1 and stats.offloaded_tensors == 0
