"""``mpi_auto``: the exchange chosen from the measured link and compute.

:mod:`.rule` (the rule, its decisions, checkpoints and logs), :mod:`.choice` (what to train with,
as pure functions), :mod:`.measure` (what a decision measures), :mod:`.arms` (the rules it trains
with) and :mod:`.heal` (what the survivors agree after a heal).
"""

from lightning_mpi.rules.auto.rule import AutoRule, BoundAuto

__all__ = ["AutoRule", "BoundAuto"]
