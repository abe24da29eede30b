import pytest


@pytest.fixture
def MPI():  # noqa: N802  (mpi4py's name)
    """mpi4py's ``MPI``, imported when a test needs it: importing it initialises MPI (this process
    becomes a world of one, and ``COMM_SELF`` / ``COMM_WORLD`` have one rank)."""
    from mpi4py import MPI

    return MPI
