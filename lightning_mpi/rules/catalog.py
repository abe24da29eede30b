"""The rules the strategies offer, one entry each, in the order the strategy classes are listed.

The strategy layer builds one named strategy class per rule (``EASGDRule`` -> ``EASGDStrategy``,
:mod:`lightning_mpi.strategies.build`) and reaches a rule only through the contract of
:mod:`lightning_mpi.rules.base`: a new rule is one package (or module) under ``rules/``, one entry
here, and its names in the table of :mod:`lightning_mpi.strategies.registry`.
"""

from __future__ import annotations

from lightning_mpi.rules.auto import AutoRule
from lightning_mpi.rules.averaging import ModelAveragingRule
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.rules.diloco import DiLoCoRule, StreamingDiLoCoRule
from lightning_mpi.rules.easgd import EASGDRule
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.hybrid import HybridRule
from lightning_mpi.rules.powersgd import PowerSGDRule
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule
from lightning_mpi.rules.sync import SyncRule

#: Every rule a strategy class trains with.
RULES: tuple[type[Rule], ...] = (
    SyncRule,
    CompressedSyncRule,
    EASGDRule,
    ModelAveragingRule,
    DownpourRule,
    AGNRule,
    ADAGRule,
    DynSGDRule,
    AEASGDRule,
    EAMSGDRule,
    GoSGDRule,
    PowerSGDRule,
    DiLoCoRule,
    StreamingDiLoCoRule,
    HybridRule,
    AutoRule,
)

#: The rule of a strategy given none (``MPIStrategy()``): synchronous gradient averaging.
DEFAULT_RULE: type[Rule] = SyncRule
