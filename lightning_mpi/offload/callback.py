"""``LMSOffload``: Large Model Support for ``pytorch_lightning``, as one callback.

The only module of :mod:`lightning_mpi.offload` that imports Lightning. The behaviour is
:class:`lightning_mpi.offload.hooks.LMSOffloadHooks`; this module only makes it a
``pytorch_lightning.Callback``.
"""
from __future__ import annotations

import pytorch_lightning as pl

from lightning_mpi.offload.hooks import LMSOffloadHooks

__all__ = ["LMSOffload"]


class LMSOffload(LMSOffloadHooks, pl.Callback):
    # One docstring for the contract, shared with the mixin that implements it.
    __doc__ = LMSOffloadHooks.__doc__
