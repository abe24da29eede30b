"""lightning_mpi's classes for the unified package's Fabric (``import lightning as L; L.Fabric``, ``lightning.fabric``).

The same strategies, with the same arguments, as ``lightning_mpi.SyncStrategy`` and friends (which
are built on ``pytorch_lightning``), built on ``lightning.fabric``. The ``mpi_*`` names need no import
from here: ``import lightning_mpi`` registers them with every Lightning package.
"""

from lightning_mpi.strategies.build import fabric_classes

globals().update(fabric_classes("lightning.fabric"))
__all__ = sorted(fabric_classes("lightning.fabric"))
