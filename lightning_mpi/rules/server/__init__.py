"""The parameter-server rules: a center variable sharded over every rank's one-sided window.

:mod:`.rules` (DOWNPOUR, AGN, DynSGD, ADAG, AEASGD, EAMSGD), :mod:`.base` (what they share: the
sharded center, commits and pulls, checkpoints), :mod:`.commits` (each rule's formula) and
:mod:`.heal` (the center rebuilt after a heal).
"""

from lightning_mpi.rules.server.base import BoundServerRule, ServerRule
from lightning_mpi.rules.server.rules import (
    ADAGRule,
    AEASGDRule,
    AGNRule,
    DownpourRule,
    DynSGDRule,
    EAMSGDRule,
)

__all__ = [
    "ADAGRule",
    "AEASGDRule",
    "AGNRule",
    "BoundServerRule",
    "DownpourRule",
    "DynSGDRule",
    "EAMSGDRule",
    "ServerRule",
]
