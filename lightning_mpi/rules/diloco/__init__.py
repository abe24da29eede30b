"""DiLoCo and Streaming DiLoCo: local steps, then an outer step on the averaged pseudo-gradient.

:mod:`.rule` (the algorithm, the shared options and the running rule, healing included),
:mod:`.streaming` (Streaming DiLoCo's fragments and schedule), :mod:`.fragments` (one fragment's
buffers and exchange), :mod:`.outer` (the outer step's math), :mod:`.period` (``period`` and
``period="auto"``), :mod:`.warning` (the slow-exchange warning) and :mod:`.state` (what a
checkpoint and a heal hold).
"""

from lightning_mpi.rules.diloco.rule import BoundDiLoCo, DiLoCoRule, OuterOptions
from lightning_mpi.rules.diloco.streaming import StreamingDiLoCoRule

__all__ = ["BoundDiLoCo", "DiLoCoRule", "OuterOptions", "StreamingDiLoCoRule"]
