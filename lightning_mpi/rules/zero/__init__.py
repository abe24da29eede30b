"""ZeRO stages 1 and 2 on ASA: the optimizer state and the reduced gradients sharded over the ranks.

:mod:`.rule` (the rule and the global gradient norm), :mod:`.layout` (the buckets and chunks),
:mod:`.bucket` (one bucket's exchanges), :mod:`.schedule` (when the buckets go),
:mod:`.optimizer` (the optimizer over this rank's pieces), :mod:`.state` (the shard format of
checkpoints) and :mod:`.mirror` (the buddy copies under ``heal``).
"""

from lightning_mpi.rules.zero.rule import BoundZeroRule, ZeroRule

__all__ = ["BoundZeroRule", "ZeroRule"]
