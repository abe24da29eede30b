"""LMSOffload as a Lightning callback: its arguments, training math, what it offloads, its files.

Checked for real on the CPU with the disk tier; CUDA runs are in ``test_tiers.py``.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from lightning_mpi.offload import LMSOffload
from lightning_mpi.offload.disk import DiskTier
from tests.offload.helpers import (
    STEPS,
    StatsRecorder,
    assert_bitwise_equal,
    fds_into,
    fit_unet,
    lms_threads,
    reference_state,
)


# --- constructor contract ---------------------------------------------------------------------
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"target": "gpu"}, ["target", "'gpu'", "cpu", "disk"]),
        ({"min_bytes": -1}, ["min_bytes", "-1", ">= 0"]),
        ({"keep_last": 1.5}, ["keep_last", "1.5", ">= 0"]),
        ({"prefetch": -2}, ["prefetch", "-2", ">= 0"]),
        ({"max_inflight": 0}, ["max_inflight", "0", ">= 1"]),
        ({"max_inflight": True}, ["max_inflight", "True", ">= 1"]),
        ({"target": "cpu", "directory": "/tmp"}, ["directory", "'/tmp'", "target='disk'"]),
        ({"target": "disk", "exclude_modules": [3]}, ["exclude_modules", "[3]"]),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, words):
    with pytest.raises(ValueError) as info:
        LMSOffload(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.timeout(30)
def test_unknown_excluded_module_raises_at_setup(tmp_path):
    lms = LMSOffload(target="disk", directory=tmp_path, exclude_modules=("enc1", "no_such_block"))
    with pytest.raises(ValueError, match="no_such_block.*enc1"):
        fit_unet([lms], steps=1)


# --- training math is unchanged ---------------------------------------------------------------
CPU_CASES = {
    "fp32": dict(),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "grad-accumulation": dict(accumulate=2),
    "non-reentrant-checkpoint": dict(use_checkpoint=True),
    "reentrant-checkpoint": dict(use_checkpoint=True, reentrant=True),
    "manual-optimization": dict(manual=True),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_disk_target_weights_bitwise_identical(case, tmp_path):
    kwargs = CPU_CASES[case]
    reference = reference_state(**kwargs)
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=1, prefetch=2, max_inflight=2)
    recorder = StatsRecorder(lms)
    model, trainer = fit_unet([lms, recorder], **kwargs)
    assert_bitwise_equal(reference, model.state_dict())
    # not vacuous: every step really went through the disk
    assert len(recorder.steps) == STEPS * kwargs.get("accumulate", 1)
    for step in recorder.steps:
        assert step["stats"].offloaded_tensors >= 3
        assert step["stats"].offloaded_bytes >= 3 * 4096
        assert step["stats"].file_bytes >= step["stats"].offloaded_bytes
    assert trainer.callback_metrics["lms/offloaded_bytes"].item() == recorder.steps[-1]["stats"].offloaded_bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep_last, prefetch", [(0, 0), (0, 1), (3, 8)])
def test_disk_weights_bitwise_identical_for_any_window_and_horizon(keep_last, prefetch, tmp_path):
    reference = reference_state()
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=keep_last, prefetch=prefetch, max_inflight=1)
    model, _ = fit_unet([lms])
    assert_bitwise_equal(reference, model.state_dict())
    assert lms.last_stats.offloaded_tensors > 0


@pytest.mark.timeout(60)
def test_cpu_target_on_cpu_warns_once_and_installs_no_hooks():
    reference = reference_state()
    lms = LMSOffload(target="cpu", min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = fit_unet([lms])
    mine = [w for w in caught if "LMSOffload(target='cpu')" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert model.hook_probe == [None] * STEPS  # no saved_tensors_hooks during training_step
    assert lms.last_stats is None
    assert_bitwise_equal(reference, model.state_dict())


@pytest.mark.timeout(60)
def test_disk_target_hooks_are_active_only_inside_the_training_step(tmp_path):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096)
    model, _ = fit_unet([lms], steps=2)
    assert len(model.hook_probe) == 2 and all(probe is not None for probe in model.hook_probe)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # popped after fit


# --- what is offloaded ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_parameters_buffers_and_small_tensors_are_never_offloaded(tmp_path, monkeypatch):
    offloaded = []
    original = DiskTier.swap_out

    def spy(self, tensor, layout, version):
        offloaded.append((tensor.untyped_storage().data_ptr(), layout.nbytes, tuple(tensor.shape)))
        return original(self, tensor, layout, version)

    monkeypatch.setattr(DiskTier, "swap_out", spy)
    min_bytes = 2 * 2 * 8**3 * 4 + 1  # just above a batch of 2-channel 8^3 fp32 maps: the logits stay
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=min_bytes, keep_last=0)
    model, _ = fit_unet([lms], steps=2)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    assert offloaded, "nothing was offloaded: the test would prove nothing"
    assert all(nbytes >= min_bytes for _, nbytes, _ in offloaded)
    assert not any(ptr in storages for ptr, _, _ in offloaded)
    assert not any(len(shape) == 5 and shape[1] == 2 for _, _, shape in offloaded)  # logits stay


@pytest.mark.timeout(60)
def test_excluded_modules_keep_their_tensors_resident(tmp_path, monkeypatch):
    # Channel counts tell the saving module apart: only enc1's first conv saves a 1-channel
    # volume (the input), only head saves a 14-channel one (the concatenation).
    channels = []
    original = DiskTier.swap_out

    def spy(self, tensor, *args):
        if tensor.dim() == 5:
            channels.append(tensor.shape[1])
        return original(self, tensor, *args)

    monkeypatch.setattr(DiskTier, "swap_out", spy)
    fit_unet([LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=0)], steps=1)
    assert 1 in channels and 14 in channels  # offloaded normally...
    channels.clear()
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=0, exclude_modules=["enc1", "head"])
    fit_unet([lms], steps=1)
    assert channels and 1 not in channels and 14 not in channels  # ...but not from excluded modules


# --- pools and files ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_disk_pool_does_not_grow_and_files_are_freed_every_step(tmp_path):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=1)
    recorder = StatsRecorder(lms, str(tmp_path))
    threads_before = lms_threads()
    fit_unet([lms, recorder], steps=4)
    sizes = [step["stats"].file_bytes for step in recorder.steps]
    assert sizes[0] > 0 and len(set(sizes)) == 1, sizes  # the same spill size every step
    offloaded = [step["stats"].offloaded_bytes for step in recorder.steps]
    assert len(set(offloaded)) == 1, offloaded
    assert all(step["files"] == [] and step["fds"] == [] for step in recorder.steps)  # freed each step
    assert lms_threads() <= threads_before  # the I/O thread stopped at teardown


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_files_are_gone_after_a_step_that_raised(tmp_path, where):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=0, prefetch=2)
    threads_before = lms_threads()
    fit_unet([lms], steps=3, raise_at=(1, where), expect_error=f"boom in {where}")
    assert lms.last_stats.offloaded_bytes > 0  # the failed step had offloaded (and the files...)
    assert os.listdir(tmp_path) == []
    assert fds_into(str(tmp_path)) == []  # ...are closed: their space is released
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert lms_threads() <= threads_before


@pytest.mark.timeout(60)
def test_default_directory_is_temporary_and_removed(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    lms = LMSOffload(target="disk", min_bytes=4096)
    fit_unet([lms], steps=1)
    assert lms.last_stats.offloaded_bytes > 0
    assert os.listdir(tmp_path) == []
