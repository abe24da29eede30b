"""PowerSGD: a low-rank approximation of the mean gradient, one power iteration a step.

:mod:`.rule` (the algorithm and the rule), :mod:`.bucket` (one bucket's exchange) and
:mod:`.lowrank` (the low-rank math as pure functions).
"""

from lightning_mpi.rules.powersgd.rule import BoundPowerSGD, PowerSGDRule

__all__ = ["BoundPowerSGD", "PowerSGDRule"]
