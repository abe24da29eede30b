"""The rank from the MPI launcher's environment, for Lightning's output before any strategy
exists (issue 27, item 6). Under ``mpiexec -n 2``: ``tests/strategies/test_first_steps.py``."""

import logging

import pytest

from lightning_mpi.strategies.launch_rank import RankPrefix, rank_from_environment, tell_lightning


@pytest.mark.parametrize(
    "environ, rank",
    [
        ({"PMI_RANK": "3"}, 3),  # MPICH / Intel MPI (Hydra)
        ({"OMPI_COMM_WORLD_RANK": "2", "PMIX_RANK": "2"}, 2),  # Open MPI
        ({"PMIX_RANK": "5"}, 5),  # srun --mpi=pmix
        ({"SLURM_PROCID": "7"}, 7),  # srun
        ({"SLURM_PROCID": "0", "PMI_RANK": "1"}, 1),  # mpiexec inside an allocation: the batch step's 0 is stale
        ({}, None),  # plain python
        ({"RANK": "1"}, None),  # torchrun: Lightning reads RANK itself
        ({"PMI_RANK": ""}, None),
    ],
)
def test_rank_from_environment(environ, rank):
    assert rank_from_environment(environ) == rank


def test_tell_lightning_sets_rank_zero_only_and_labels_the_seed_message():
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    logger = logging.getLogger("lightning_fabric.utilities.seed")
    before, filters = rank_zero_only.rank, list(logger.filters)
    try:
        assert tell_lightning("pytorch_lightning", {}) is None and rank_zero_only.rank == before
        assert tell_lightning("pytorch_lightning", {"PMI_RANK": "1"}) == 1
        assert rank_zero_only.rank == 1
        tell_lightning("lightning_fabric", {"PMI_RANK": "1"})  # a second package: one filter
        prefixes = [f for f in logger.filters if isinstance(f, RankPrefix)]
        assert len(prefixes) == 1
        record = logging.LogRecord("lightning_fabric.utilities.seed", logging.INFO, "", 0, "Seed set to 0", (), None)
        assert prefixes[0].filter(record) and record.getMessage() == "[rank: 1] Seed set to 0"
        prefixes[0].filter(record)
        assert record.getMessage() == "[rank: 1] Seed set to 0"  # once
    finally:
        rank_zero_only.rank = before
        logger.filters[:] = filters
