"""Spare ranks (lightning_mpi.comm.spares): the count the launcher exports, the split of the job,
and a job whose spare is never needed (its let-in after a loss is tested under Open MPI with the
``replace_rules`` launch of tests/strategies/test_heal.py)."""

from __future__ import annotations

import json

import pytest

from tests.mpi_utils import REPO, run_mpi


def test_the_spare_count_comes_from_the_launcher_and_bad_values_are_named():
    from lightning_mpi.comm.spares import SPARES_ENV, requested

    assert requested({}) == 0 and requested({SPARES_ENV: ""}) == 0
    assert requested({SPARES_ENV: "2"}) == 2
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match=rf"LIGHTNING_MPI_SPARES='{bad}': expected a whole number"):
            requested({SPARES_ENV: bad})


def test_a_job_of_spares_only_is_refused_naming_the_fix():
    from mpi4py import MPI

    from lightning_mpi.comm.spares import split_off_spares

    with pytest.raises(ValueError, match=r"1 spare ranks in a job of 1: no rank would train; launch more ranks"):
        split_off_spares(MPI.COMM_WORLD, 1)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_an_unneeded_spare_waits_outside_the_run_and_is_dismissed_at_the_end(tmp_path):
    """3 ranks, the last a spare: the two others train as a run of 2 (Fabric's world size, an
    all_reduce of ones) and the spare, which never got past its strategy's construction, leaves
    when rank 0 dismisses it at exit: mpiexec exits 0."""
    run_mpi(3, [str(REPO / "tests" / "scripts" / "spares_idle.py"), str(tmp_path)], env={"LIGHTNING_MPI_SPARES": "1"})
    records = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(records) == ["rank0.json", "rank1.json"]  # the spare (rank 2) never trained
    assert [(r["world_size"], r["rank"], r["ones"]) for _, r in sorted(records.items())] == [(2, 0, 2.0), (2, 1, 2.0)]
