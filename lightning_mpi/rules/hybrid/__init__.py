"""Two levels (``mpi_hybrid``): every step inside a host, (Streaming) DiLoCo across hosts.

:mod:`.rule` (the algorithm, the options and the running rule, healing included), :mod:`.layout`
(replicas and the pieces each rank carries), :mod:`.pieces` (a fragment's sharded exchange across
replicas) and :mod:`.state` (what a checkpoint and a heal hold).
"""

from lightning_mpi.rules.hybrid.rule import BoundHybrid, HybridRule

__all__ = ["BoundHybrid", "HybridRule"]
