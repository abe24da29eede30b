import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

#: The multi-rank core that CI also runs under the other MPI (Open MPI; see .ci/run), by node id
#: prefix: sync equivalence (4 exchanges, W = 2), a compressed rule, the one-sided center of the
#: asynchronous rules (W = 3), failures caught in every phase of a sync, a compressed, a
#: parameter-server and the gossip rule then a second fit (W = 2, with 20 failed-and-retried fits
#: checked for leaks), an unhandled failure, and a restart. Tests marked ``openmpi_core`` where
#: they are defined join them: healing, the launcher with Open MPI. About 2 minutes of tests on a
#: 2-core machine; kept here in one place so that the core is easy to see and stays cheap.
OPENMPI_CORE = (
    "tests/strategies/test_sync.py::test_ranks_match_one_process_with_world_batch[W2-",
    "tests/strategies/test_compressed.py::test_lossless_cases_match_fp32_asa_bitwise",
    "tests/strategies/test_async.py::test_no_lost_update_on_sharded_center",
    "tests/strategies/test_rank_failures.py::test_every_rank_catches_within_seconds_and_the_next_fit_trains[W2]",
    "tests/strategies/test_rank_failures.py::test_failed_and_retried_fits_leak_nothing[W2]",
    "tests/strategies/test_rank_failures.py::test_an_unhandled_failure_ends_every_rank_with_its_traceback",
    "tests/launcher/test_restarts.py::test_max_restarts_resumes_a_rank_killed_mid_epoch_on_the_hosts_left",
)

#: ``LIGHTNING_MPI_TEST_MPI=openmpi`` (or ``mpich``): the MPI this test run must find (the
#: environment's mpiexec); the run stops at once when it finds another.
TEST_MPI_ENV = "LIGHTNING_MPI_TEST_MPI"


def pytest_configure(config):
    wanted = os.environ.get(TEST_MPI_ENV)
    if wanted:
        from tests.mpi_utils import mpi_flavor, mpiexec_path

        found = mpi_flavor()
        if found != wanted:
            raise pytest.UsageError(
                f"{TEST_MPI_ENV}={wanted}, but this environment's mpiexec ({mpiexec_path()}) is {found}; "
                f"activate the environment of that MPI (.ci/run makes .venv for MPICH, .venv-ompi for Open MPI)"
            )


def _mark_openmpi_core(config, items):
    matched = set()
    for item in items:
        for prefix in OPENMPI_CORE:
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.openmpi_core)
                matched.add(prefix)
    # Selecting the core (-m openmpi_core) over the whole suite: a renamed test must not drop out silently.
    if "openmpi_core" in (config.getoption("markexpr") or "") and not config.args[1:] and len(items) > 100:
        stale = [p for p in OPENMPI_CORE if p not in matched]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py OPENMPI_CORE names tests that no longer exist: {stale}")


CUDA_SKIP_REASON = "needs a CUDA device: on a GPU machine `python benchmarks/gpu_check.py` runs every test marked cuda"


def pytest_collection_modifyitems(config, items):
    _mark_openmpi_core(config, items)
    _skip_cuda(items)
    _skip_plots(items)


def _skip_cuda(items):
    """Tests marked ``cuda`` are skipped where torch sees no CUDA device.

    The marker is the one way a test says it needs a GPU, so that ``pytest -m cuda`` (what
    ``benchmarks/gpu_check.py`` runs) selects exactly those tests. torch is imported only when such a
    test was collected.
    """
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in marked:
        item.add_marker(skip)


PLOTS_SKIP_REASON = (
    "writes figures: needs matplotlib (pip install -e \".[plots]\"); ./run test runs the tests marked plots "
    "last, after installing it"
)


def _skip_plots(items):
    """Tests marked ``plots`` are skipped where matplotlib is not installed.

    The test environment leaves matplotlib out on purpose: torchmetrics, which Lightning imports,
    imports it whenever it is installed (about 1.2 s of CPU in every rank of every launch).
    ``./run test`` runs the rest of the suite first, then installs it and runs these.
    """
    marked = [item for item in items if item.get_closest_marker("plots") is not None]
    if not marked:
        return
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return
    skip = pytest.mark.skip(reason=PLOTS_SKIP_REASON)
    for item in marked:
        item.add_marker(skip)
