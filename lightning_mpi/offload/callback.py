"""``LMSOffload`` on ``pytorch_lightning``: :class:`lightning_mpi.offload.hooks.LMSOffloadHooks` on its ``Callback``.

The class is built by :mod:`lightning_mpi.strategies.build`, like every Lightning-facing class of
lightning_mpi, and is the same object as ``lightning_mpi.LMSOffload``; the unified package's is
``lightning_mpi.lightning.LMSOffload``. Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

from lightning_mpi.strategies.build import trainer_classes

__all__ = ["LMSOffload"]

LMSOffload = trainer_classes("pytorch_lightning")["LMSOffload"]
