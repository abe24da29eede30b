"""Lightning's collectives over MPI (``strategies/run_collectives.py``): two ranks that call different
collectives get a clear error on every rank, never each other's bytes, and the run goes on."""

import json

import pytest

from tests.mpi_utils import run_mpi_code

MISMATCH = """
import json, sys
import torch
import lightning_mpi
from lightning_mpi.comm.transport import CollectiveMismatch

strategy = lightning_mpi.SyncStrategy()
rank = strategy.global_rank
seen = {}
for name, mine in (
    ("kinds", lambda: strategy.reduce(torch.ones(3)) if rank == 0 else strategy.all_gather(torch.ones(3))),
    ("shapes", lambda: strategy.reduce(torch.ones(3 + rank))),
    ("metric_or_barrier", lambda: strategy.barrier() if rank == 0 else strategy._metric_allgather({"n": 1})),
):
    try:
        mine()
        seen[name] = "no error"
    except CollectiveMismatch as error:
        seen[name] = [str(error), error.calls]
seen["after"] = strategy.reduce(torch.ones(2) * rank, reduce_op="sum").tolist()  # the run goes on
with open(f"seen{rank}.json", "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_ranks_in_different_collectives_raise_a_clear_error_and_go_on(tmp_path):
    run_mpi_code(2, MISMATCH, tmp_path, timeout=170)
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in range(2)]
    for rank, mine in enumerate(seen):
        message, calls = mine["kinds"]
        assert calls == ["reduce (mean) of torch.float32[3]", "all_gather of torch.float32[3]"], rank
        assert "the ranks called different collectives" in message and "so no data was exchanged" in message
        assert mine["shapes"][1] == ["reduce (mean) of torch.float32[3]", "reduce (mean) of torch.float32[4]"]
        assert mine["metric_or_barrier"][1] == ["barrier", "a metric's sync"]
        assert mine["after"] == [1.0, 1.0]
