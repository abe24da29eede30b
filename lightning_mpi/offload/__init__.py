"""Activation offload (Large Model Support): ``LMSOffload`` and the parts it is made of.

Tensors that autograd saves for backward (activations, mostly) leave the device during forward
and come back, prefetched in backward order, just before backward needs them; the device holds
only what is being computed. IBM's Large Model Support trained 3D U-Nets at 2.4x the resolution
that fit a 16 GB GPU this way, at 3-25% overhead, with MPI data parallelism.

Usage::

    trainer = pl.Trainer(strategy="mpi_asa", callbacks=[lightning_mpi.LMSOffload()])

The modules, each with one job (only :mod:`.callback` imports Lightning):

* :mod:`.callback`: ``LMSOffload``, the ``pytorch_lightning`` Callback.
* :mod:`.hooks`: ``LMSOffloadHooks``, the callback's behaviour as Lightning-free hook methods.
* :mod:`.session`: which saved tensors leave the device and when they come back (one step).
* :mod:`.tiers`: the tier contract (``Ticket``, ``TierStats``) and CUDA -> pinned host memory.
* :mod:`.disk`: the disk tier (spill files).
* :mod:`.streams`: CUDA side streams, their safety rules and copy timing.
* :mod:`.pool`: reusable (pinned) host buffers.
* :mod:`.tensors`: tensors as bytes plus a layout.
* :mod:`.allocator`: glibc's mmap threshold, so freed activations leave the process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_mpi.offload.hooks import LMSOffloadHooks
from lightning_mpi.offload.session import OffloadStats

if TYPE_CHECKING:
    from lightning_mpi.offload.callback import LMSOffload

__all__ = ["LMSOffload", "LMSOffloadHooks", "OffloadStats"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that the Lightning-free modules of this package can be used
    # (and tested) without importing Lightning.
    if name == "LMSOffload":
        from lightning_mpi.offload.callback import LMSOffload

        return LMSOffload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
