"""Activation offload (Large Model Support): ``LMSOffload`` and the parts it is made of.

Tensors that autograd saves for backward (activations, mostly) leave the device during forward
and come back, prefetched in backward order, just before backward needs them; the device holds
only what is being computed. IBM's Large Model Support trained 3D U-Nets at 2.4x the resolution
that fit a 16 GB GPU this way, at 3-25% overhead, with MPI data parallelism.

Usage::

    trainer = pl.Trainer(strategy="mpi_asa", callbacks=[lightning_mpi.LMSOffload()])

The modules, each with one job (none imports Lightning: ``lightning_mpi.LMSOffload``, also
``lightning_mpi.offload.LMSOffload``, is :class:`.hooks.LMSOffloadHooks` on ``pytorch_lightning``'s
``Callback``, built by :mod:`lightning_mpi.strategies.build`):

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

from typing import Any

from lightning_mpi.offload.hooks import LMSOffloadHooks
from lightning_mpi.offload.session import OffloadStats

__all__ = ["LMSOffload", "LMSOffloadHooks", "OffloadStats"]


def __getattr__(name: str) -> Any:
    # An alias of lightning_mpi.LMSOffload, resolved on first use: the Callback is built by the
    # strategy layer (the only place that touches Lightning), so this package imports no Lightning.
    if name == "LMSOffload":
        import lightning_mpi

        return lightning_mpi.LMSOffload
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
