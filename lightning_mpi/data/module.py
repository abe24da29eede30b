"""``PrefetchDataModule`` on ``pytorch_lightning``: :class:`~lightning_mpi.data.hooks.PrefetchDataHooks`
on its ``LightningDataModule``.

The class is built by :mod:`lightning_mpi.strategies.build`, like every Lightning-facing class of
lightning_mpi, and is the same object as ``lightning_mpi.PrefetchDataModule``; the unified
package's is ``lightning_mpi.lightning.PrefetchDataModule``. Importing this module imports
``pytorch_lightning``.
"""

from __future__ import annotations

from lightning_mpi.strategies.build import trainer_classes

__all__ = ["PrefetchDataModule"]

PrefetchDataModule = trainer_classes("pytorch_lightning")["PrefetchDataModule"]
