"""lightning_mpi's classes for the unified package's Trainer (``import lightning as L; L.Trainer``,
``lightning.pytorch``).

The same strategies, with the same arguments, as ``lightning_mpi.SyncStrategy`` and friends (which
are built on ``pytorch_lightning``), built on ``lightning.pytorch``. The ``mpi_*`` names need no import
from here: ``import lightning_mpi`` registers them with every Lightning package.
"""

from lightning_mpi.strategies.build import trainer_classes

globals().update(trainer_classes("lightning.pytorch"))
__all__ = sorted(trainer_classes("lightning.pytorch"))
