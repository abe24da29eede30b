"""comm/ring: the allreduces over point-to-point messages (a ring, recursive doubling) that transports
use under Open MPI's fault tolerance, on 3 and 4 ranks (3 is no power of two and divides no
buffer length here), against one process's math."""

import json

import pytest

from lightning_mpi.comm.ring import chunk_bounds
from tests.mpi_utils import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "ring_allreduce.py")


def test_chunks_cover_the_buffer_in_order_as_evenly_as_possible():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [3, 4])
def test_every_rank_ends_with_the_same_reduction_of_all_ranks_values(tmp_path, size):
    out = tmp_path / "ring.json"
    run_mpi(size, [SCRIPT, str(out)], timeout=150)
    seen = json.loads(out.read_text())
    assert seen.pop("ring") is True
    # every case ran (products of the 3 short lengths only), each algorithm on its own, the long one
    assert len(seen) == 5 * 3 * 3 + 3 * 3 + 2 * 3 + 1 + 2
    for name, case in seen.items():
        assert case["identical"], f"{name}: the ranks ended with different bytes"
        exact = "int64" in name or name.startswith(("max", "min"))
        assert case["error"] <= (0.0 if exact else 1e-3), (name, case)
