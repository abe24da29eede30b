"""Run on 3 ranks: comm/'s objects between ranks, in one launch (tests/comm/test_comm_on_three_ranks.py).

- one-sided windows updated by every rank at once (ShardedVector, Counters) and a DecisionBoard;
- Mailbox messages around a ring;
- a run that fails on rank 1: the others' waits raise RankFailedError, rank 1 lingers until they
  acknowledged; the run is abandoned, and the next run's reclaim settles its mailbox and frees
  its handles (after refusing to when the ranks disagree on what was abandoned);
- a late error message from an abandoned generation is dropped;
- transport objects: node_split, object collectives, a barrier that one rank never joins.

Every rank records what it saw; rank 0 writes all of it as JSON to argv[1], and the test compares
it with what one process computes.
"""

import json
import os
import sys
import traceback
import warnings

import torch
from mpi4py import MPI

from lightning_mpi.comm.errors import ERROR_TAG, ErrorChannel, RankFailedError
from lightning_mpi.comm.mailbox import Mailbox
from lightning_mpi.comm.reclaim import reclaim
from lightning_mpi.comm.resources import RunResources, live_handles
from lightning_mpi.comm.transport import CollectiveTimeout, Transport
from lightning_mpi.comm.window import Counters, DecisionBoard, ShardedVector

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
seen: dict = {}


def windows() -> None:
    n = SIZE * 5
    vector = ShardedVector(WORLD, n, torch.float64)
    vector.init_local(torch.arange(n, dtype=torch.float64))
    counters = Counters(WORLD, 1)
    WORLD.Barrier()
    old = torch.empty(n, dtype=torch.float64)
    vector.add(torch.full((n,), float(10**RANK), dtype=torch.float64), old=old)  # every rank at once
    seen["counter_old"] = counters.fetch_add(0, 10**RANK)
    WORLD.Barrier()
    seen["vector_old"] = old.tolist()
    seen["vector_final"] = vector.read(torch.empty(n, dtype=torch.float64)).tolist()
    seen["counter_final"] = int(counters.read()[0])
    vector.free()
    counters.free()


def decision_board() -> None:
    """Four boards, each asked the questions 0, 1, ... by every rank at its own pace (random
    sleeps) until a few past its stop: rank 1 votes at its question 10 (a reduction, any); rank 0
    broadcasts a stop at 5; the ranks vote at 3, 7 and 12 (a reduction, all); and rank 0 broadcasts
    at 5 with a collective run every 6 questions (``count = q // 6``, as Lightning's loop would).
    Each rank records the question it stopped at, the collectives behind it, and whether it was
    answered False before it and True from it on."""
    import random
    import time

    pace = random.Random(RANK)
    scenarios = {
        "any_vote": (lambda board, q: board.reduce_flag(RANK == 1 and q == 10, False, q), lambda q: 0),
        "broadcast": (lambda board, q: board.broadcast_flag(RANK == 0 and q >= 5, 0, q), lambda q: 0),
        "all_votes": (lambda board, q: board.reduce_flag(q >= (3, 7, 12)[RANK], True, q), lambda q: 0),
        "counted": (lambda board, q: board.broadcast_flag(RANK == 0 and q >= 5, 0, q, q // 6), lambda q: q // 6),
    }
    flags = {}
    for name, (ask, count) in scenarios.items():
        board = DecisionBoard(WORLD)
        answers: list[bool] = []
        for q in range(20000):  # until a few questions past the stop (each rank at its own pace)
            time.sleep(pace.uniform(0, 0.002) * (1 + 3 * RANK))  # the higher the rank, the slower
            answers.append(ask(board, q))
            if answers[-1] and len(answers) > answers.index(True) + 3:
                break
        first = answers.index(True) if True in answers else None
        flags[name] = {
            "first": first,
            "collectives": None if first is None else count(first),
            "frozen": board.stop_at,
            "once": first is not None and all(a == (q >= first) for q, a in enumerate(answers)),
        }
        WORLD.Barrier()
        board.free()
    seen["board"] = flags


def mailbox_ring(box: Mailbox) -> None:
    after, before = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    box.send(after, torch.full((4,), 10.0 * RANK + 1))
    box.send(after, torch.full((4,), 10.0 * RANK + 2))
    box.send(before, torch.full((4,), 10.0 * RANK + 3))
    seen["mailbox_got"] = [box.wait_for_one()[0].item() for _ in range(3)]
    box.finish_sends()
    WORLD.Barrier()


def failed_run_and_reclaim() -> None:
    baseline = live_handles()
    channel = ErrorChannel(WORLD, linger_seconds=120.0)  # lingers until acknowledged, or the test times out
    failed = RunResources(serial=1)
    transport = Transport(failed.comm(WORLD.Dup()), timeout=60, errors=channel, resources=failed)
    box = Mailbox(transport, numel=4)
    mailbox_ring(box)
    vector = ShardedVector(WORLD, SIZE, torch.float32, resources=failed)
    counters = Counters(WORLD, 2, resources=failed)
    WORLD.Barrier()
    # Messages nobody will receive in this run: one to the next rank, and rank 1 sends rank 0 two.
    box.send((RANK + 1) % SIZE, torch.zeros(4))
    if RANK == 1:
        box.send(0, torch.zeros(4))
        box.send(0, torch.zeros(4))
    if RANK == 1:
        channel.post(ValueError("boom"))  # and never joins the barrier below
        channel.linger()
        seen["lingered"] = True
    else:
        try:
            transport.barrier()
            seen["barrier"] = "completed"
        except RankFailedError as error:
            seen["barrier"] = [error.rank, error.error]
    failed.abandon()
    channel.next_generation()
    box.close()  # no-ops on an abandoned run: the next run frees them
    vector.free()
    counters.free()
    if RANK == 1:
        transport.comm.Ibarrier().Wait()  # the barrier the others started, so that theirs completes
    seen["abandoned_counts"] = failed.counts()

    fresh_run = RunResources(serial=2)
    fresh = Transport(fresh_run.comm(WORLD.Dup()), timeout=60, errors=channel, resources=fresh_run)
    mine = [failed, RunResources(serial=99)] if RANK == 2 else [failed]  # rank 2 disagrees
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = reclaim(mine, fresh)
    seen["disagreement"] = {
        "kept": len(kept),
        "warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
        "counts": failed.counts(),
    }
    seen["reclaimed"] = reclaim([failed], fresh)
    seen["counts_after"] = failed.counts()
    seen["settled"] = {"received_from": box.received_from, "sent_to": fresh.allgather_object(box.sent_to)}
    channel.check()  # nothing left of the failed run
    # Unwatched: a watched barrier may still be polling on one rank when rank 2 posts below,
    # and would rightly raise.
    WORLD.Barrier()

    # A late message about an abandoned generation is dropped, not raised.
    if RANK == 2:
        channel.post(RuntimeError("late"))
    else:
        channel.comm.Probe(source=2, tag=ERROR_TAG)  # it has arrived
    channel.next_generation()
    if RANK != 2:
        channel.check()
        seen["late_message_left"] = channel.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    fresh.barrier()
    fresh_run.free_comm(fresh.comm)
    seen["handles_back"] = live_handles() == baseline
    channel.close()


def transport_objects() -> None:
    os.environ["LIGHTNING_MPI_RANKS_PER_NODE"] = "2"  # pretend nodes: ranks {0, 1} and {2}
    transport = Transport(WORLD, timeout=60)
    local, leaders = transport.node_split()
    seen["node_split"] = [local.rank, local.size, None if leaders is None else [leaders.rank, leaders.size]]
    seen["allgather_object"] = transport.allgather_object({"rank": RANK})
    seen["broadcast_object"] = transport.broadcast_object(f"from {RANK}", root=2)
    local.free()
    if leaders is not None:
        leaders.free()

    impatient = Transport(WORLD, timeout=60).dup()  # made patiently: ranks may start late
    impatient.timeout = 0.2
    if RANK != 2:
        try:
            impatient.barrier()
            seen["timeout"] = "completed"
        except CollectiveTimeout as error:
            seen["timeout"] = str(error)
    WORLD.Barrier()
    if RANK == 2:
        impatient.comm.Ibarrier().Wait()  # joins late: the others' kept requests complete too
    impatient.free()
    WORLD.Barrier()


def main() -> None:
    windows()
    decision_board()
    failed_run_and_reclaim()
    transport_objects()
    everyone = WORLD.gather(seen, root=0)
    if RANK == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(everyone, out)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        WORLD.Abort(1)  # a failing rank never hangs the others
