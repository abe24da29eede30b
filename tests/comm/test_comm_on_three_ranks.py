"""comm/'s objects between ranks: one ``mpiexec -n 3`` launch (tests/scripts/comm_objects.py), each
rank's observations compared with what one process computes."""

import json

import pytest

from tests.mpi_utils import REPO, run_mpi

SCRIPT = str(REPO / "tests" / "scripts" / "comm_objects.py")
SIZE = 3
DELTAS = [10**r for r in range(SIZE)]  # what each rank adds: every subset has its own sum


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_objects") / "seen.json"
    run_mpi(SIZE, [SCRIPT, str(out)], timeout=120)
    return json.loads(out.read_text())


def assert_applied_one_at_a_time(start, olds, deltas):
    """``olds[r]`` is what rank r's atomic add found: ``start`` plus the deltas of the ranks whose
    add came before, in some order. Nothing lost, nothing torn."""
    prefix = start
    for rank in sorted(range(len(olds)), key=lambda r: olds[r]):
        assert olds[rank] == prefix
        prefix += deltas[rank]
    return prefix


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_windows_take_concurrent_updates_without_losing_any(seen):
    n = len(seen[0]["vector_final"])
    for i in range(n):
        total = assert_applied_one_at_a_time(float(i), [s["vector_old"][i] for s in seen], DELTAS)
        assert all(s["vector_final"][i] == total == i + sum(DELTAS) for s in seen)
    assert assert_applied_one_at_a_time(0, [s["counter_old"] for s in seen], DELTAS) == sum(DELTAS)
    assert all(s["counter_final"] == sum(DELTAS) for s in seen)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_the_decision_board_stops_every_rank_with_the_same_collectives_behind_it(seen):
    """Every rank answers False, then True from one question on. The fastest rank stops at the
    frozen question, the same on every rank; a slower one stops there or before, but never with
    fewer (or more) collectives behind it than the others (each rank keeps its own pace)."""
    for name in ("any_vote", "broadcast", "all_votes", "counted"):
        boards = [s["board"][name] for s in seen]
        assert all(b["once"] for b in boards), (name, boards)
        (frozen,) = {b["frozen"] for b in boards}
        assert frozen is not None and all(b["first"] <= frozen for b in boards), (name, boards)
        assert max(b["first"] for b in boards) == frozen, (name, boards)
        assert {b["collectives"] for b in boards} == {frozen // 6 if name == "counted" else 0}, (name, boards)
    voters = [s["board"]["all_votes"]["first"] for s in seen]
    assert voters[2] >= 12, ("rank 2 votes last, at 12: nobody stops before it has", voters)
    assert seen[1]["board"]["any_vote"]["first"] >= 10, "rank 1 votes at 10"


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_mailbox_messages_arrive_in_the_order_each_sender_sent_them(seen):
    for rank, s in enumerate(seen):
        before, after = (rank - 1) % SIZE, (rank + 1) % SIZE
        got = s["mailbox_got"]
        assert sorted(got) == sorted([10 * before + 1, 10 * before + 2, 10 * after + 3])
        assert got.index(10 * before + 1) < got.index(10 * before + 2)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_failed_run_stops_the_others_and_is_reclaimed_by_the_next(seen):
    assert [s.get("barrier") for s in seen] == [[1, "ValueError: boom"], None, [1, "ValueError: boom"]]
    assert seen[1]["lingered"], "the failing rank stopped lingering once both others acknowledged"
    for rank, s in enumerate(seen):
        assert s["abandoned_counts"] == [1, 4, 2, 1]  # 4 communicators, 2 windows, 1 mailbox
        # The ranks disagreed on what was abandoned: all of them kept everything, and said so.
        assert s["disagreement"]["kept"] == (2 if rank == 2 else 1)
        assert s["disagreement"]["counts"] == [1, 4, 2, 1]
        assert any("abandoned different failed runs" in w for w in s["disagreement"]["warned"])
        # Then they agreed: everything freed, every message sent to this rank received.
        assert s["reclaimed"] == [] and s["counts_after"] == [1, 0, 0, 0]
        sent_to = s["settled"]["sent_to"]
        assert s["settled"]["received_from"] == [sent_to[source][rank] for source in range(SIZE)]
        assert s["handles_back"]
    assert [s.get("late_message_left") for s in seen] == [False, False, None], "dropped, not raised"


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_transport_objects_on_three_ranks(seen):
    assert [s["node_split"] for s in seen] == [[0, 2, [0, 2]], [1, 2, None], [0, 1, [1, 2]]]
    assert all(s["allgather_object"] == [{"rank": r} for r in range(SIZE)] for s in seen)
    assert all(s["broadcast_object"] == "from 2" for s in seen)
    for rank in (0, 1):
        assert f"barrier on rank {rank} waited more than 0.2 s for the other 2 rank(s)" in seen[rank]["timeout"]
    assert "timeout" not in seen[2]
