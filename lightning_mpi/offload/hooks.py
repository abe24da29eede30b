"""``LMSOffloadHooks``: what the ``LMSOffload`` callback does, written without Lightning.

The hook methods have the names and signatures of Lightning's ``Callback`` hooks and use only
what every Lightning frontend's trainer and module provide (``trainer.global_rank``,
``pl_module.device``, ``named_modules()``, ``log_dict``), so one mixin serves
``pytorch_lightning`` and ``lightning.pytorch`` alike; :mod:`lightning_mpi.offload.callback`
adds the ``Callback`` base class.

How it hooks into Lightning: ``torch.autograd.graph.saved_tensors_hooks`` is entered in
``on_train_batch_start`` and exited in ``on_train_batch_end``. Everything a training batch runs in
between is covered, whichever way Lightning runs it: automatic optimization (forward and backward
inside the closure that ``optimizer.step`` calls), manual optimization, gradient accumulation,
the precision plugin's autocast. ``on_before_backward`` starts the prefetch early. The context is
also exited (and the step's files freed) in ``on_exception``, ``on_train_epoch_end`` (a module
returning -1 from ``on_train_batch_start`` skips ``on_train_batch_end``), and ``teardown``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.autograd.graph import saved_tensors_hooks

from lightning_mpi.offload.allocator import return_freed_memory_to_os
from lightning_mpi.offload.disk import DiskTier
from lightning_mpi.offload.pool import HostBufferPool
from lightning_mpi.offload.session import OffloadSession, OffloadStats
from lightning_mpi.offload.tiers import CudaHostTier

__all__ = ["LMSOffloadHooks", "OffloadStats"]

_TARGETS = ("cpu", "disk")


class LMSOffloadHooks:
    """Offload the tensors saved for backward out of device memory during each training step.

    Args:
        target: Where saved tensors go. ``"cpu"``: CUDA tensors go to pinned host memory (a
            reusable pool, copies on a side stream). Nothing to do for a model on the CPU: the
            callback then warns once and installs no hooks. ``"disk"``: tensors (CUDA or CPU) go
            to a spill file in ``directory``; on a CPU-only machine this lowers peak RSS.
        directory: Directory for ``target="disk"`` (created if missing; shared by ranks without
            collisions). ``None``: a fresh temporary directory, removed at teardown. Must be
            ``None`` for ``target="cpu"``.
        min_bytes: Saved tensors smaller than this stay resident (a copy costs more than it
            frees). ``>= 0``.
        keep_last: The last ``keep_last`` offloadable tensors of each forward pass stay
            resident: backward uses them first. ``>= 0``.
        prefetch: Prefetch horizon: how many offloaded tensors are brought back ahead of use,
            in backward order. ``0`` fetches each tensor only when backward asks for it. ``>= 0``.
        max_inflight: Most swap-out copies in flight at once; forward waits when there are
            more (bounds the memory held by pending copies). ``>= 1``.
        exclude_modules: Names (as in ``named_modules()``) of submodules whose saved tensors
            stay resident. Checked against the LightningModule at setup.
        log_stats: Log per-step stats with ``LightningModule.log`` (``lms/offloaded_bytes``,
            ``lms/peak_saved_bytes``, ``lms/copy_hidden_ms``, ``lms/copy_exposed_ms``).
            :attr:`last_stats` is always set.

    On a CPU-only machine with ``target="disk"``, the callback also sets glibc's mmap threshold
    (once per process, via ``mallopt``) so that freed activations go back to the OS; without it
    glibc keeps them in its heap and peak RSS does not drop. Set ``MALLOC_MMAP_THRESHOLD_`` (or
    ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``) yourself to choose another value; the
    callback then leaves it alone. The threshold makes every large allocation (gradients too)
    page-fault in fresh memory, which on a model of low arithmetic intensity is most of the
    offload's cost (a deep 256-wide MLP: +0.8 s of system time on a 1.8 s step, 324k faults);
    launching with ``THP_MEM_ALLOC_ENABLE=1`` (torch) or ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
    (glibc), with transparent huge pages in ``madvise`` mode, cuts the faults 8-16x. Both are read
    at process start, so the callback cannot set them; it warns once when neither is set.

    Contract: training math is unchanged (weights bitwise identical to a run without the
    callback). Parameters, buffers and autocast copies of parameters are never offloaded. Saved
    tensors live until ``on_train_batch_end``; a graph that outlives its step cannot be
    unpacked. A saved tensor modified in place raises at unpack, as plain autograd does. Each
    MPI rank offloads into its own host memory or files; nothing is communicated.

    Raises:
        ValueError: at construction, for an argument out of range (the message names the
            argument, the value and the allowed range); at setup, for an unknown module name.

    Usage::

        trainer = pl.Trainer(strategy="mpi_asa", callbacks=[lightning_mpi.LMSOffload()])

    This class holds the behaviour; ``LMSOffload`` is this mixin on Lightning's ``Callback``. A
    callback for another Lightning frontend is ``class X(LMSOffloadHooks, Callback)``: the hooks
    need nothing Lightning-specific from ``trainer`` and ``pl_module`` beyond the common API.
    """

    def __init__(
        self,
        target: Literal["cpu", "disk"] = "cpu",
        directory: str | os.PathLike | None = None,
        min_bytes: int = 1 << 20,
        keep_last: int = 2,
        prefetch: int = 2,
        max_inflight: int = 4,
        exclude_modules: Sequence[str] = (),
        log_stats: bool = True,
    ) -> None:
        super().__init__()
        if target not in _TARGETS:
            raise ValueError(f"LMSOffload: target={target!r} is not supported; expected one of {_TARGETS}")
        if directory is not None:
            if target != "disk":
                raise ValueError(
                    f"LMSOffload: directory={directory!r} only applies to target='disk' (got target={target!r})"
                )
            if not isinstance(directory, (str, os.PathLike)) or os.path.isfile(directory):
                raise ValueError(f"LMSOffload: directory={directory!r} must be a directory path (str or os.PathLike)")
        self.target = target
        self.directory = None if directory is None else os.fspath(directory)
        self.min_bytes = _check_int("min_bytes", min_bytes, 0)
        self.keep_last = _check_int("keep_last", keep_last, 0)
        self.prefetch = _check_int("prefetch", prefetch, 0)
        self.max_inflight = _check_int("max_inflight", max_inflight, 1)
        if isinstance(exclude_modules, str):
            exclude_modules = (exclude_modules,)
        if not all(isinstance(name, str) for name in exclude_modules):
            raise ValueError(
                f"LMSOffload: exclude_modules={exclude_modules!r} must be a sequence of module names (str)"
            )
        self.exclude_modules = tuple(exclude_modules)
        self.log_stats = bool(log_stats)
        self.last_stats: OffloadStats | None = None

        self._tier: Any = None
        self._session: OffloadSession | None = None
        self._hooks_ctx: saved_tensors_hooks | None = None
        self._module_hooks: list = []
        self._owned_dir: str | None = None
        self._warned: set[str] = set()  # messages already given

    # --- Lightning Callback hooks (same names and signatures) ---------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._hook_excluded_modules(pl_module)
        if self.target == "disk":
            self._prepare_directory(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._end_step(abort=True)  # a step whose on_train_batch_end never came
        device = pl_module.device
        if self.target == "cpu" and device.type != "cuda":
            self._warn_once(
                trainer,
                f"LMSOffload(target='cpu'): the model is on {device.type}, so there is no device memory "
                "to free; the callback does nothing (no hooks installed). Use target='disk' to lower host memory.",
            )
            return
        if self._tier is None:
            self._tier = self._make_tier(trainer, device)
        accepts = _on_cuda if self.target == "cpu" else _on_cpu_or_cuda
        session = OffloadSession(self._tier, accepts, self.min_bytes, self.keep_last, self.prefetch)
        session.start(_storages_of(pl_module))
        self._session = session
        self._hooks_ctx = saved_tensors_hooks(session.pack, session.unpack)
        self._hooks_ctx.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._session is not None:
            self._session.begin_backward()  # start prefetching while the kept-last tensors are used

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = self._end_step(abort=False)
        if stats is not None and stats.captured_tensors:
            self._warn_once(
                trainer,
                "LMSOffload: tensors were saved for backward while a CUDA graph was being captured "
                "(torch.cuda.graph, make_graphed_callables); they stay on the device: an offload "
                "cannot be part of a captured graph, so the callback saves no memory there.",
            )
        if stats is not None and self.log_stats:
            pl_module.log_dict(
                {
                    "lms/offloaded_bytes": float(stats.offloaded_bytes),
                    "lms/peak_saved_bytes": float(stats.peak_saved_bytes),
                    "lms/copy_hidden_ms": stats.hidden_ms,
                    "lms/copy_exposed_ms": stats.exposed_ms,
                },
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_step(abort=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._shutdown()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._shutdown()

    # --- internals ------------------------------------------------------------------------
    def _end_step(self, abort: bool) -> OffloadStats | None:
        """Exit the hooks context and end the session; returns the step's stats."""
        session, self._session = self._session, None
        ctx, self._hooks_ctx = self._hooks_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if session is None:
            return None
        stats = session.abort() if abort else session.finish()
        self.last_stats = stats
        return stats

    def _shutdown(self) -> None:
        """Everything back as it was: hooks popped, files closed, threads stopped, pools freed."""
        try:
            self._end_step(abort=True)
        finally:
            tier, self._tier = self._tier, None
            if tier is not None:
                tier.close()
            for handle in self._module_hooks:
                handle.remove()
            self._module_hooks = []
            if self._owned_dir is not None:
                shutil.rmtree(self._owned_dir, ignore_errors=True)
                self._owned_dir = None

    def _make_tier(self, trainer: Any, device: torch.device) -> Any:
        if self.target == "cpu":
            return CudaHostTier(HostBufferPool(pin_memory=True), self.max_inflight)
        if device.type == "cpu":
            # Offloaded activations are freed mid-forward; glibc must hand that memory back to
            # the OS or peak RSS does not drop. Clamped to glibc's accepted range (<= 32 MiB) and
            # kept >= 128 KiB so small allocations stay on the fast heap path.
            if return_freed_memory_to_os(min(max(self.min_bytes, 128 << 10), 32 << 20)) and not _huge_pages_asked():
                self._warn_once(
                    trainer,
                    "LMSOffload(target='disk'): freed activations now go back to the OS, so every large "
                    "CPU allocation (activations, gradients) page-faults in fresh memory; on a model of low "
                    "arithmetic intensity that is most of the offload's cost. Launch with "
                    "THP_MEM_ALLOC_ENABLE=1 (torch's huge pages for CPU tensors) or "
                    "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 to cut it (both are read at startup).",
                )
        directory = self._owned_dir or self.directory
        assert directory is not None, "setup() prepares the directory before the first step"
        return DiskTier(directory, self.max_inflight, name=f"lms-rank{trainer.global_rank}")

    def _prepare_directory(self, trainer: Any) -> None:
        if self.directory is None:
            if self._owned_dir is None:
                self._owned_dir = tempfile.mkdtemp(prefix="lms-offload-")
            return
        os.makedirs(self.directory, exist_ok=True)
        fs_type = _filesystem_type(self.directory)
        if fs_type in ("tmpfs", "ramfs"):
            self._warn_once(
                trainer,
                f"LMSOffload: directory={self.directory!r} is on {fs_type} (memory): offloading there "
                "lowers this process's RSS but not the machine's memory use.",
            )

    def _hook_excluded_modules(self, pl_module: Any) -> None:
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        modules = dict(pl_module.named_modules())
        unknown = [name for name in self.exclude_modules if name not in modules]
        if unknown:
            known = [name for name in modules if name][:12]
            raise ValueError(
                f"LMSOffload: exclude_modules={list(unknown)!r} not found in {type(pl_module).__name__}; "
                f"names come from named_modules(), e.g. {known}"
            )
        for name in self.exclude_modules:
            module = modules[name]
            self._module_hooks.append(module.register_forward_pre_hook(self._enter_excluded))
            self._module_hooks.append(module.register_forward_hook(self._leave_excluded, always_call=True))

    def _enter_excluded(self, module: torch.nn.Module, args: Any) -> None:
        if self._session is not None:
            self._session.excluded_depth += 1

    def _leave_excluded(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._session is not None and self._session.excluded_depth > 0:
            self._session.excluded_depth -= 1

    def _warn_once(self, trainer: Any, message: str) -> None:
        """Give ``message`` once per callback, on global rank 0 only (every rank would say the
        same)."""
        if message not in self._warned:
            self._warned.add(message)
            if trainer.global_rank == 0:
                warnings.warn(message, UserWarning, stacklevel=3)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"LMSOffload: {name}={value!r} is out of range; expected an int >= {low}")
    return value


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _on_cpu_or_cuda(t: torch.Tensor) -> bool:
    return t.device.type in ("cpu", "cuda")


def _storages_of(module: torch.nn.Module) -> set[int]:
    """Storage addresses of parameters and buffers: tensors saved from them (or views of them)
    stay resident."""
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages.update(b.untyped_storage().data_ptr() for b in module.buffers())
    return storages


def _huge_pages_asked() -> bool:
    """Whether this process was started with huge pages for its large CPU allocations (torch's
    ``THP_MEM_ALLOC_ENABLE`` or glibc's ``hugetlb`` tunable)."""
    torch_thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0").strip().lower() not in ("", "0", "false", "no")
    return torch_thp or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", "")


def _filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount-point match in /proc/mounts),
    or "" where that is unknown."""
    path = os.path.realpath(path)
    best, fs_type = "", ""
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fs_type = mount, fields[2]
    except OSError:
        return ""
    return fs_type
