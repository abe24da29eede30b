"""The rank of this process, from the MPI launcher's environment, for Lightning's rank-zero output.

Lightning decides at import which process prints its "rank zero only" messages
(``rank_zero_only.rank``, read from ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID`` or
``JSM_NAMESPACE_RANK``), and prefixes the per-rank "Seed set to 0" with ``[rank: N]`` from the
same variables. ``mpiexec`` sets none of them, so before the strategy exists (and sets the rank from
``MPI.COMM_WORLD``) every rank printed "No seed found" and an unprefixed "Seed set to 0". Every MPI
launcher tells its processes their rank in the environment; :func:`rank_from_environment` reads it
without initialising MPI, and :func:`tell_lightning` gives it to the Lightning package being
registered (:mod:`.registry` calls it on import):

- ``rank_zero_only.rank`` (one object shared by every Lightning package, from
  ``lightning_utilities``): ``rank_zero_info``/``rank_zero_warn`` messages print once, on rank 0;
- a filter on the ``seed_everything`` logger gives its per-rank message the ``[rank: N]`` prefix that
  Lightning adds under ``torchrun`` or ``srun``. That message is per rank on purpose
  (``seed_everything(verbose=True)``: "print a message on each rank"; ranks may seed differently),
  so it is labelled, not hidden.

The environment is trusted only when it carries an MPI launcher's variables; a process without
them (plain ``python train.py``, ``torchrun``) is left to Lightning.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping

#: The launchers' rank variables, most specific first. ``mpiexec`` inside a Slurm allocation
#: leaves the batch step's ``SLURM_PROCID`` (0 on every rank) in the environment, so the MPI
#: launchers' own variables come before Slurm's.
RANK_VARIABLES = (
    "PMI_RANK",  # MPICH / Intel MPI (Hydra), MVAPICH with PMI
    "PMIX_RANK",  # PMIx: Open MPI 5, srun --mpi=pmix
    "OMPI_COMM_WORLD_RANK",  # Open MPI
    "MV2_COMM_WORLD_RANK",  # MVAPICH2's own launcher
    "SLURM_PROCID",  # srun
)


def rank_from_environment(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's rank as its MPI launcher (or ``srun``) announced it, or ``None`` when no
    launcher variable is set (or none holds an integer)."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


class RankPrefix(logging.Filter):
    """Prefixes a record's message with ``[rank: N] `` (Lightning's ``rank_prefixed_message``
    format) unless it already has one."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("[rank: "):
            record.msg = f"[rank: {self.rank}] {record.msg}"
        return True


def tell_lightning(package: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """Give Lightning package ``package`` (a Trainer or Fabric package, already imported) the rank
    from the launch environment; returns it, or ``None`` (nothing changed) outside an MPI launch.

    Idempotent. A strategy constructed later sets the same rank from ``MPI.COMM_WORLD``.
    """
    rank = rank_from_environment(environ)
    if rank is None:
        return None
    fabric = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}.get(package, package)
    importlib.import_module(f"{fabric}.utilities.rank_zero").rank_zero_only.rank = rank
    seed_logger = logging.getLogger(f"{fabric}.utilities.seed")
    if not any(isinstance(existing, RankPrefix) for existing in seed_logger.filters):
        seed_logger.addFilter(RankPrefix(rank))
    return rank
