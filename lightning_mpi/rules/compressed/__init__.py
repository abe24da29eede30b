"""Synchronous gradient averaging with lossy compression (int8, 1-bit, top-k) and error feedback.

:mod:`.rule` (the rule, its options and checkpoints), :mod:`.exchanger` (each bucket's compressed
exchange) and :mod:`.momentum_handoff` (DGC's momentum correction beside the optimizer's own).
"""

from lightning_mpi.rules.compressed.rule import BoundCompressedSync, CompressedSyncRule

__all__ = ["BoundCompressedSync", "CompressedSyncRule"]
