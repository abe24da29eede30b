"""LMSOffload: offloading tensors saved for backward, checked for real on the CPU with the disk tier.

CUDA paths (pinned pool, side streams) run only where a GPU is present; they are skipped with a
reason otherwise. Every model here is tiny: the whole file runs in well under a minute on a shared
2-core box.
"""
from __future__ import annotations

import json
import os
import threading
import warnings
import weakref

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpi.offload import LMSOffload
from lightning_mpi.offload_disk import DiskTier
from lightning_mpi.offload_pool import HostBufferPool, size_class
from lightning_mpi.offload_session import OffloadSession
from tests.mpi_utils import run_mpi_code

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU: pinned-memory pool, side streams and record_stream are CUDA-only"
)

SEED = 1234
STEPS = 3


# --- a tiny 3D U-Net-like module --------------------------------------------------------------
class TinyUNet3d(pl.LightningModule):
    """enc1 -> down -> enc2 -> up -> concat skip -> head. Channel counts are distinct so tests can
    tell which module saved a tensor. In-place ReLU and BatchNorm on purpose: both interact with
    saved tensors."""

    def __init__(self, use_checkpoint: bool = False, manual: bool = False, raise_at: tuple[int, str] | None = None):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv3d(1, 6, 3, padding=1), nn.BatchNorm3d(6), nn.ReLU(inplace=True))
        self.down = nn.Conv3d(6, 8, 2, stride=2)
        self.enc2 = nn.Sequential(nn.Conv3d(8, 8, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose3d(8, 8, 2, stride=2)
        self.head = nn.Conv3d(14, 2, 1)
        self.use_checkpoint = use_checkpoint
        self.automatic_optimization = not manual
        self.raise_at = raise_at  # (step, "forward" | "backward")
        self.hook_probe: list[object] = []

    def forward(self, x):
        a = self.enc1(x)
        b = self.down(a)
        if self.use_checkpoint:
            b = checkpoint(self.enc2, b, use_reentrant=False)
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


def _data(n=8, side=8):
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
            entry["fds"] = _fds_into(self.directory)
        self.steps.append(entry)


def _fit(callbacks=(), steps=STEPS, precision="32-true", accumulate=1, expect_error=None, **module_kwargs):
    pl.seed_everything(SEED, verbose=False)
    model = TinyUNet3d(**module_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    if expect_error is None:
        trainer.fit(model, _data())
    else:
        with pytest.raises(RuntimeError, match=expect_error):
            trainer.fit(model, _data())
    return model, trainer


_REFERENCE: dict = {}


def _reference(**kwargs):
    """Final state of a run without the callback (cached: several tests compare against it)."""
    key = tuple(sorted(kwargs.items()))
    if key not in _REFERENCE:
        _REFERENCE[key] = _fit(**kwargs)[0].state_dict()
    return _REFERENCE[key]


def _assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _fds_into(directory: str) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(os.path.realpath(directory)):
            found.append(target)
    return found


def _lms_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("lms-")}


@pytest.fixture
def tiers():
    """Disk tiers made by a test, closed even when it fails (their I/O threads stop)."""
    made = []
    yield made
    for tier in made:
        tier.close()


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
        _fit([lms], steps=1)


# --- training math is unchanged ---------------------------------------------------------------
CPU_CASES = {
    "fp32": dict(),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "grad-accumulation": dict(accumulate=2),
    "non-reentrant-checkpoint": dict(use_checkpoint=True),
    "manual-optimization": dict(manual=True),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_disk_target_weights_bitwise_identical(case, tmp_path):
    kwargs = CPU_CASES[case]
    reference = _reference(**kwargs)
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=1, prefetch=2, max_inflight=2)
    recorder = StatsRecorder(lms)
    model, trainer = _fit([lms, recorder], **kwargs)
    _assert_bitwise_equal(reference, model.state_dict())
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
    reference = _reference()
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=keep_last, prefetch=prefetch, max_inflight=1)
    model, _ = _fit([lms])
    _assert_bitwise_equal(reference, model.state_dict())
    assert lms.last_stats.offloaded_tensors > 0


@pytest.mark.timeout(60)
def test_cpu_target_on_cpu_warns_once_and_installs_no_hooks():
    reference = _reference()
    lms = LMSOffload(target="cpu", min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = _fit([lms])
    mine = [w for w in caught if "LMSOffload(target='cpu')" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert model.hook_probe == [None] * STEPS  # no saved_tensors_hooks during training_step
    assert lms.last_stats is None
    _assert_bitwise_equal(reference, model.state_dict())


@pytest.mark.timeout(60)
def test_disk_target_hooks_are_active_only_inside_the_training_step(tmp_path):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096)
    model, _ = _fit([lms], steps=2)
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
    model, _ = _fit([lms], steps=2)
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
    _fit([LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=0)], steps=1)
    assert 1 in channels and 14 in channels  # offloaded normally...
    channels.clear()
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=1024, keep_last=0, exclude_modules=["enc1", "head"])
    _fit([lms], steps=1)
    assert channels and 1 not in channels and 14 not in channels  # ...but not from excluded modules


class RecordingTier(DiskTier):
    """A disk tier that records the order of swap-outs, fetches and takes, and the prefetch
    depth."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out, self.fetched, self.taken, self.max_ahead = [], [], [], 0

    def swap_out(self, tensor, layout, version):
        ticket = super().swap_out(tensor, layout, version)
        ticket.extra["index"] = len(self.out)
        self.out.append(ticket)
        return ticket

    def fetch(self, ticket):
        if ticket.read is None and not ticket.done:
            self.fetched.append(ticket.extra["index"])
        super().fetch(ticket)
        ahead = sum(1 for t in self.out if t.read is not None and not t.done)
        self.max_ahead = max(self.max_ahead, ahead)

    def take(self, ticket):
        self.taken.append(ticket.extra["index"])
        return super().take(ticket)


def _chain_session(tmp_path, n, keep_last, prefetch, tiers, nbytes=16384):
    """n ops that each save a distinct tensor of nbytes, through a session on a recording tier."""
    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=nbytes, keep_last=keep_last, prefetch=prefetch)
    session.start(set())
    x = torch.randn(nbytes // 4, requires_grad=True)
    with saved_tensors_hooks(session.pack, session.unpack):
        h = x
        for _ in range(n):
            h = (h * 0.5).exp()  # exp saves its output: one new tensor per op
        loss = h.sum()
    return tier, session, x, loss


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep_last, prefetch", [(0, 1), (2, 3), (4, 0)])
def test_keep_last_window_and_prefetch_in_backward_order(tmp_path, keep_last, prefetch, tiers):
    n = 10
    tier, session, x, loss = _chain_session(tmp_path, n, keep_last, prefetch, tiers)
    assert len(tier.out) == n - keep_last  # the last keep_last saved tensors stayed resident
    session.begin_backward()
    assert tier.fetched == list(range(n - keep_last - 1, n - keep_last - 1 - prefetch, -1))  # ahead of use
    loss.backward()
    backward_order = list(range(n - keep_last - 1, -1, -1))
    assert tier.taken == backward_order
    assert tier.fetched == backward_order  # prefetch 0: each one fetched when backward asks
    assert tier.max_ahead <= max(prefetch, 1)
    stats = session.finish()
    assert stats.offloaded_tensors == n - keep_last
    assert stats.peak_saved_bytes == (n - keep_last) * 16384


@pytest.mark.timeout(30)
def test_a_graph_dropped_without_backward_releases_its_copies(tmp_path, tiers):
    tier, session, x, loss = _chain_session(tmp_path, 6, keep_last=0, prefetch=2, tiers=tiers)
    session.begin_backward()  # two reads are now in flight
    assert len(tier.out) == 6 and sum(t.read is not None for t in tier.out) == 2
    del loss  # the graph, and with it every handle, goes away
    assert all(t.done and t.read is None for t in tier.out)  # copies and prefetches released
    stats = session.finish()
    assert stats.offloaded_tensors == 6


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
@pytest.mark.parametrize("keep_last", [0, 5])
def test_in_place_change_after_saving_raises_like_autograd(tmp_path, keep_last, tiers):
    tier = DiskTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=1024, keep_last=keep_last, prefetch=1)
    session.start(set())
    x = torch.randn(1024, requires_grad=True)
    with saved_tensors_hooks(session.pack, session.unpack):
        y = (x * 1).exp()
        z = (y * 2).sum()
        y.add_(1)  # exp needs its output in backward
    with pytest.raises(RuntimeError, match="modified in place"):
        z.backward()
    session.abort()


@pytest.mark.timeout(30)
def test_allocator_setting_respects_the_users_own(monkeypatch):
    import lightning_mpi.offload_disk as disk

    monkeypatch.setattr(disk, "_MALLOPT_DONE", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert disk.return_freed_memory_to_os(1 << 20) is False  # the user chose: left alone
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert disk.return_freed_memory_to_os(1 << 20) is False
    assert disk._MALLOPT_DONE is False


# --- pools and files ------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_disk_pool_does_not_grow_and_files_are_freed_every_step(tmp_path):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=1)
    recorder = StatsRecorder(lms, str(tmp_path))
    threads_before = _lms_threads()
    _fit([lms, recorder], steps=4)
    sizes = [step["stats"].file_bytes for step in recorder.steps]
    assert sizes[0] > 0 and len(set(sizes)) == 1, sizes  # the same spill size every step
    offloaded = [step["stats"].offloaded_bytes for step in recorder.steps]
    assert len(set(offloaded)) == 1, offloaded
    assert all(step["files"] == [] and step["fds"] == [] for step in recorder.steps)  # freed each step
    assert _lms_threads() <= threads_before  # the I/O thread stopped at teardown


@pytest.mark.timeout(30)
def test_host_buffer_pool_reuses_buffers_across_steps():
    # The size pattern of a real step (a few repeated activation sizes), five times over.
    sizes = [262144, 262144, 131072, 98304, 262144, 5000, 131072]
    pool = HostBufferPool(pin_memory=CUDA)
    reserved = []
    for _ in range(5):
        lent = [pool.acquire(n) for n in sizes]
        assert all(buf.numel() >= n for buf, n in zip(lent, sizes))
        for buf in lent:
            pool.release(buf)
        stats = pool.stats()
        assert stats.in_use_bytes == 0
        reserved.append((stats.reserved_bytes, stats.allocations))
    assert reserved == [reserved[0]] * 5
    assert reserved[0][0] == sum(size_class(n) for n in sizes)
    pool.clear()
    assert pool.stats().reserved_bytes == 0


class _PendingEvent:
    """Stands in for a CUDA event whose copy has not finished."""

    done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.mark.timeout(30)
def test_host_buffer_pool_reuses_a_busy_buffer_only_in_stream_order():
    pool = HostBufferPool(pin_memory=False)
    side, other = object(), object()  # stand-ins for two CUDA streams
    buf = pool.acquire(100_000, stream=side)
    event = _PendingEvent()
    pool.release(buf, after=event, stream=side)  # an h2d copy on `side` still reads it
    assert pool.acquire(100_000) is not buf  # the host must not write into it
    assert pool.acquire(100_000, stream=other) is not buf  # nor a copy on another stream
    assert pool.acquire(100_000, stream=side) is buf  # a copy queued behind it on `side` may
    assert pool.stats().allocations == 3
    event.done = True


@pytest.mark.timeout(30)
def test_size_classes_waste_at_most_an_eighth():
    for n in [1, 4095, 4097, 10**5, 3 * 2**20 + 1, 2**30 - 3]:
        cls = size_class(n)
        assert n <= cls and (cls <= 4096 or cls - n < cls / 8)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_files_are_gone_after_a_step_that_raised(tmp_path, where):
    lms = LMSOffload(target="disk", directory=tmp_path, min_bytes=4096, keep_last=0, prefetch=2)
    threads_before = _lms_threads()
    _fit([lms], steps=3, raise_at=(1, where), expect_error=f"boom in {where}")
    assert lms.last_stats.offloaded_bytes > 0  # the failed step had offloaded (and the files...)
    assert os.listdir(tmp_path) == []
    assert _fds_into(str(tmp_path)) == []  # ...are closed: their space is released
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _lms_threads() <= threads_before


@pytest.mark.timeout(60)
def test_default_directory_is_temporary_and_removed(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    lms = LMSOffload(target="disk", min_bytes=4096)
    _fit([lms], steps=1)
    assert lms.last_stats.offloaded_bytes > 0
    assert os.listdir(tmp_path) == []


# --- CUDA (skipped without a GPU) -----------------------------------------------------------
def _fit_cuda(callbacks=(), precision="32-true", steps=STEPS):
    pl.seed_everything(SEED, verbose=False)
    model = TinyUNet3d()
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(model, _data())
    return model.cpu().state_dict()


@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_cuda_weights_bitwise_identical(target, precision, tmp_path):
    reference = _fit_cuda(precision=precision)
    kwargs = {"directory": tmp_path} if target == "disk" else {}
    lms = LMSOffload(target=target, min_bytes=4096, keep_last=1, **kwargs)
    _assert_bitwise_equal(reference, _fit_cuda([lms], precision=precision))
    assert lms.last_stats.offloaded_bytes > 0


@needs_cuda
@pytest.mark.timeout(120)
def test_cuda_pinned_pool_does_not_grow():
    lms = LMSOffload(target="cpu", min_bytes=4096, keep_last=0)
    seen = []

    class PoolProbe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(lms._tier.pool.stats().reserved_bytes)

    _fit_cuda([lms, PoolProbe()], steps=4)
    assert seen[0] > 0 and seen == [seen[0]] * 4


# --- with an MPI strategy ---------------------------------------------------------------------
def _mpi_asa_registered() -> bool:
    import lightning_mpi  # noqa: F401  (importing registers the strategies)
    from pytorch_lightning.strategies import StrategyRegistry

    return "mpi_asa" in StrategyRegistry


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_with_mpi_asa_on_two_ranks(tmp_path):
    if not _mpi_asa_registered():
        pytest.skip("strategy 'mpi_asa' is not registered yet (lightning_mpi.strategy has not landed)")
    spill = tmp_path / "spill"
    code = f"""
    import hashlib, json, os
    import torch
    import lightning_mpi
    import pytorch_lightning as pl
    from mpi4py import MPI
    from lightning_mpi.offload import LMSOffload
    from tests.test_offload import TinyUNet3d, _data, SEED

    torch.set_num_threads(1)
    def run(callbacks):
        pl.seed_everything(SEED, verbose=False)
        model = TinyUNet3d()
        trainer = pl.Trainer(strategy="mpi_asa", accelerator="cpu", max_steps=3, callbacks=callbacks,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(model, _data())
        # Parameters: BatchNorm running stats are per-rank (each rank normalises its own shard).
        blob = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        return hashlib.sha256(blob).hexdigest()

    plain = run([])
    lms = LMSOffload(target="disk", directory={str(spill)!r}, min_bytes=4096, keep_last=1)
    offloaded = run([lms])
    rank = MPI.COMM_WORLD.Get_rank()
    with open(f"result_{{rank}}.json", "w") as f:  # a file per rank: stdout lines of ranks interleave
        json.dump(dict(rank=rank, plain=plain, offloaded=offloaded, bytes=lms.last_stats.offloaded_bytes,
                       left=os.listdir({str(spill)!r})), f)
    """
    result = run_mpi_code(2, code, tmp_path, timeout=150)
    files = sorted(tmp_path.glob("result_*.json"))
    assert len(files) == 2, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [json.loads(f.read_text()) for f in files]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert rows[0]["plain"] == rows[1]["plain"]  # the strategy keeps ranks in step
    assert all(r["offloaded"] == r["plain"] for r in rows)  # and offloading changes nothing
    assert all(r["bytes"] > 0 and r["left"] == [] for r in rows)
