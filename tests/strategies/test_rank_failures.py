"""One rank fails inside ``fit``: every rank raises (the failing one its own exception, the others
``RankFailedError`` naming it) within seconds, and a second fit trains on fresh communicators.

Every case of one world size runs in one launch (``tests/scripts/rank_failures.py``): a raise on
the last rank in setup, a training step, a validation step, a checkpoint save, the data loader and
the rule's progress thread, for a synchronous (``mpi_asa16``, overlapped), a compressed
(``mpi_asa_int8``), a parameter-server (``mpi_downpour``) and the gossip rule (``mpi_gosgd``, which
has no progress thread), at W = 2 (and a subset at W = 3, :data:`CASES_W3`); and a raise in a
``lightning_fabric`` training loop inside ``fabric.strategy.propagate_errors()``. The W = 2 launch then runs 20 failed-and-retried fits
and compares threads, open files, RSS and lightning_mpi's live communicators and windows. Nobody
catching the exception ends every rank non-zero, with the failing rank's traceback.
"""
import json
import re
import time

import pytest

from tests.mpi_utils import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "rank_failures.py")
STRATEGIES = ["mpi_asa16", "mpi_asa_int8", "mpi_downpour", "mpi_gosgd"]
PHASES = ["setup", "step", "validation", "checkpoint", "loader", "thread"]
CASES = [f"{s}/{p}" for s in STRATEGIES for p in PHASES if not (s == "mpi_gosgd" and p == "thread")]
CASES += [f"fabric:{s}/loop" for s in ("mpi_asa16", "mpi_downpour", "mpi_gosgd")]  # a raise in the user's Fabric loop
#: At W = 3 (the world size that does not divide buffers): every phase of the synchronous rule, one
#: step failure of each other rule and one Fabric loop; the full matrix runs at W = 2 (suite time).
CASES_W3 = [c for c in CASES if c.startswith("mpi_asa16/") or c.endswith("/step")] + ["fabric:mpi_gosgd/loop"]
LEAK_ROUNDS = 20
#: RSS growth allowed between the 2nd and the 20th failed-and-retried fit (measured: ~2.5 MiB, of
#: which ~1.1 MiB also comes with 36 fits that do not fail: Lightning and MPICH caches)
RSS_TOLERANCE_KIB = 8 * 1024


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def launch(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"failures{world}") / "out.json"
    extra = [str(LEAK_ROUNDS)] if world == 2 else []
    cases = CASES if world == 2 else CASES_W3
    run_mpi(world, [SCRIPT, str(out), "cases", ",".join(cases), *extra], timeout=240)
    return world, json.loads(out.read_text())


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_every_rank_catches_within_seconds_and_the_next_fit_trains(launch):
    world, result = launch
    for case, ranks in result["cases"].items():
        failing = world - 1
        for rank, r in enumerate(ranks):
            caught = r["caught"]
            if rank == failing:
                assert caught["type"] == "Injected" and f"on rank {failing}" in caught["message"], (case, caught)
            else:
                assert caught["type"] == "RankFailedError" and caught["rank"] == failing, (case, rank, caught)
                assert re.search(rf"rank {failing} failed with Injected: injected failure in .* on rank {failing}",
                                 caught["message"]), caught["message"]
            assert caught["delay"] is not None and caught["delay"] < 10, (case, rank, caught)
            assert r["global_step"] == 4, (case, rank)
        assert all(r["weights"] == ranks[0]["weights"] for r in ranks), f"{case}: the second fit ended on different weights"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_failed_and_retried_fits_leak_nothing(launch):
    world, result = launch
    if world != 2:
        pytest.skip("the leak check runs in the W = 2 launch")
    for early, late in result["leak"]:
        assert late["threads"] == early["threads"] and late["fds"] == early["fds"], (early, late)
        assert late["comms"] == early["comms"] and late["windows"] == early["windows"], (early, late)
        assert late["rss_kib"] - early["rss_kib"] < RSS_TOLERANCE_KIB, (early, late)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_an_unhandled_failure_ends_every_rank_with_its_traceback():
    result = run_mpi(2, [SCRIPT, "unused.json", "unhandled", "mpi_downpour"], timeout=100, check=False)
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "finished normally" not in output, output[-3000:]
    assert "Injected: injected failure in training_step on rank 1" in output, output[-3000:]
    assert "Traceback (most recent call last)" in output
    failed_at = float(re.search(r"failed at (\d+\.\d+)", output).group(1))
    assert ended - failed_at < 30, f"the job took {ended - failed_at:.1f} s to end after the failure"
