"""What the offload tests share: a tiny 3D U-Net, its data, and ways to fit it and compare runs.

Every model here is tiny: a fit takes a second or two on a shared 2-core box. CUDA paths
(pinned pool, side streams) run only where a GPU is present: :data:`needs_cuda` (the ``cuda``
marker) skips them otherwise.
"""
from __future__ import annotations

import os
import threading

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpi.offload import LMSOffload
from tests.quiet_trainer import QUIET_NO_VAL

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
#: Pinned-memory pool, side streams and record_stream are CUDA-only: the ``cuda`` marker skips
#: these tests without a GPU (tests/conftest.py) and ``pytest -m cuda`` selects them on one.
needs_cuda = pytest.mark.cuda

SEED = 1234
STEPS = 3


# --- a tiny 3D U-Net-like module --------------------------------------------------------------
class TinyUNet3d(pl.LightningModule):
    """enc1 -> down -> enc2 -> up -> concat skip -> head. Channel counts are distinct so tests can
    tell which module saved a tensor. In-place ReLU and BatchNorm on purpose: both interact with
    saved tensors."""

    def __init__(
        self,
        use_checkpoint: bool = False,
        reentrant: bool = False,
        manual: bool = False,
        raise_at: tuple[int, str] | None = None,
    ):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv3d(1, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU(inplace=True))
        self.down = nn.Conv3d(6, 8, 2, stride=2)
        self.enc2 = nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose3d(8, 8, 2, stride=2)
        self.head = nn.Conv3d(14, 2, 1)
        self.use_checkpoint = use_checkpoint
        self.reentrant = reentrant  # checkpoint flavour: recompute inside backward (True) or by hooks
        self.automatic_optimization = not manual
        self.raise_at = raise_at  # (step, "forward" | "backward")
        self.hook_probe: list[object] = []

    def forward(self, x):
        a = self.enc1(x)
        b = self.down(a)
        if self.use_checkpoint:
            b = checkpoint(self.enc2, b, use_reentrant=self.reentrant)
        else:
            b = self.enc2(b)
        return self.head(torch.cat([self.up(b), a], dim=1))

    def training_step(self, batch, batch_idx):
        self.hook_probe.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        x, y = batch
        logits = self(x)
        step = self.global_step if self.automatic_optimization else batch_idx
        if self.raise_at is not None and self.raise_at[0] == step:
            if self.raise_at[1] == "forward":
                raise RuntimeError("boom in forward")
            logits.register_hook(_raise_in_backward)
        # reduction="none" + mean: CUDA's fused nll_loss2d mean has no deterministic kernel
        loss = nn.functional.cross_entropy(logits.float(), y, reduction="none").mean()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _raise_in_backward(grad):
    raise RuntimeError("boom in backward")


def volume_loader(n=8, side=8):
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(n, 1, side, side, side, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=2, shuffle=False)


class StatsRecorder(pl.Callback):
    """Placed after LMSOffload: reads its per-step stats and what the step left behind."""

    def __init__(self, lms: LMSOffload, directory: str | None = None):
        self.lms, self.directory, self.steps = lms, directory, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        entry = {"stats": self.lms.last_stats}
        if self.directory is not None:
            entry["files"] = sorted(os.listdir(self.directory))
            entry["fds"] = fds_into(self.directory)
        self.steps.append(entry)


def fit_unet(callbacks=(), steps=STEPS, precision="32-true", accumulate=1, expect_error=None, **module_kwargs):
    """Fit a TinyUNet3d on the CPU; returns ``(model, trainer)``. With ``expect_error``, fit must
    raise a RuntimeError matching it."""
    pl.seed_everything(SEED, verbose=False)
    model = TinyUNet3d(**module_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        **QUIET_NO_VAL,
    )
    if expect_error is None:
        trainer.fit(model, volume_loader())
    else:
        with pytest.raises(RuntimeError, match=expect_error):
            trainer.fit(model, volume_loader())
    return model, trainer


_REFERENCE: dict = {}


def reference_state(**kwargs):
    """Final state of a run without the callback (cached: several tests compare against it)."""
    key = tuple(sorted(kwargs.items()))
    if key not in _REFERENCE:
        _REFERENCE[key] = fit_unet(**kwargs)[0].state_dict()
    return _REFERENCE[key]


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name], b[name]), f"{name} differs"


def fds_into(directory: str) -> list[str]:
    """Paths inside ``directory`` that this process holds open (spill files not yet closed)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.realpath(directory)):
            found.append(target)
    return found


def lms_threads() -> set[threading.Thread]:
    """The threads LMSOffload started (their names start with ``lms-``)."""
    return {t for t in threading.enumerate() if t.name.startswith("lms-")}


def fit_unet_cuda(callbacks=(), precision="32-true", steps=STEPS):
    """Fit on one CUDA device, deterministic kernels; returns the final state on the CPU."""
    pl.seed_everything(SEED, verbose=False)
    model = TinyUNet3d()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=list(callbacks),
        **QUIET_NO_VAL,
        deterministic=True,
    )
    trainer.fit(model, volume_loader())
    return model.cpu().state_dict()
