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
