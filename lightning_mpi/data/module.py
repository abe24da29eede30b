"""``PrefetchDataModule``: :class:`~lightning_mpi.data.hooks.PrefetchDataHooks` as a ``pytorch_lightning`` DataModule.

The only module of :mod:`lightning_mpi.data` that imports Lightning. Everything but the base
class lives in the Lightning-free hooks, so a DataModule for another Lightning frontend is one
more line like the class below.
"""
from __future__ import annotations

import pytorch_lightning as pl

from lightning_mpi.data.hooks import PrefetchDataHooks

__all__ = ["PrefetchDataModule"]


class PrefetchDataModule(PrefetchDataHooks, pl.LightningDataModule):
    __doc__ = PrefetchDataHooks.__doc__  # one contract, whichever frontend's DataModule carries it
