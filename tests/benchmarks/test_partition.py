"""A real network partition under ``lightning-mpi --heal`` (Open MPI with ULFM): 3 ranks on 3
simulated hosts (benchmarks/cluster.py: network namespaces, needs root, ``ip``, ``tc`` and
``unshare``), the host of rank 2 cut off for longer than Open MPI's detector timeout, then back.

The two ranks of the majority heal before the link is back and train on through its return; the
rank cut off stops itself (comm/quorum.py) before its own detector could report the majority failed
(a live rank reported failed aborts when the reports arrive, and that ended such runs before: 2 of
5 at 15 s), and says why. The run is goodput.py's heal arm with one fault, so
the benchmark and this test measure the same thing."""

import sys

import pytest

from tests.mpi_utils import REPO, require_ulfm

sys.path.insert(0, str(REPO))

from benchmarks import cluster as simcluster  # noqa: E402
from benchmarks import goodput as g  # noqa: E402

_reason = simcluster.unavailable_reason()

#: a 4 s detector timeout (the quorum stops the cut-off side after 2.4 s), a host cut off for 12 s
SETTINGS = g.Settings(
    ranks=3, budget=30.0, ckpt_every=100, every=6.0, max_kills=1, partition_s=12.0, drain=40.0, hang_timeout=4.0
)


@pytest.mark.openmpi_core
@pytest.mark.skipif(_reason is not None, reason=_reason or "")
@pytest.mark.timeout(240)
def test_the_majority_heals_and_trains_through_a_partition_and_the_side_cut_off_stops(tmp_path):
    require_ulfm()
    from benchmarks.cluster import SimCluster

    out = tmp_path / "run"
    with SimCluster(g.host_layout(SETTINGS.ranks)[0]) as cluster:
        result = g.run_arm(g.ARMS["heal_shrink"], SETTINGS, out, fault="partition", cluster=cluster)
    log = (out / "launcher.log").read_text(errors="replace")
    tail = log[-3000:]
    # the job lived through the cut and the link coming back (a rank of the majority reported dead by
    # the side cut off aborted there before: the job ended)
    assert result["status"] == "ok", (result.get("error"), tail)
    assert "reported dead by someone else" not in log, tail
    # the side cut off stopped itself, and said why
    assert ") hears 1 of the run's 3 training ranks (itself included) for 2.4 s, fewer than min_ranks=2" in log, tail
    # the majority healed before the link came back, and trained on after it
    assert len(result["kills"]) == 1 and "healed: rank 2 of 3 lost" in log, tail
    resume = result["recovery"][0]["resume"]
    assert resume is not None and resume < SETTINGS.partition_s, (result["recovery"], tail)
    back = result["kills"][0] + SETTINGS.partition_s
    assert result["last_step_at"] > back + 2.0, (result["last_step_at"], back, tail)
    # and ended with one set of weights; a job that stalls after the link came back (1 launch of 9
    # here, not found: docs/faults.md) is killed at the end instead, and has none to compare
    if result["end"] == "stopped":
        assert result["replicas"]["identical"] and result["replicas"]["of"] == 2, result["replicas"]
