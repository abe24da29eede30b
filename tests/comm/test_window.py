"""comm/window: one-sided windows (a sharded vector, counters, the decision board) on one rank;
three ranks updating them at once are in test_comm_on_three_ranks.py."""

import numpy as np
import pytest
import torch

from lightning_mpi.comm.resources import live_handles
from lightning_mpi.comm.window import Counters, DecisionBoard, ShardedVector, shard_bounds


def test_shard_bounds():
    assert [shard_bounds(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match=r"numel=10 must be a multiple of the world size 3 \(pad the buffer\)"):
        shard_bounds(10, 3, 0)


def test_sharded_vector_reads_adds_and_fetches_what_it_held(MPI):
    before = live_handles()
    vector = ShardedVector(MPI.COMM_SELF, 6, torch.float64)
    vector.init_local(torch.arange(6, dtype=torch.float64))
    out = torch.empty(6, dtype=torch.float64)
    assert vector.read(out) is out and out.tolist() == [0, 1, 2, 3, 4, 5]
    vector.add(torch.ones(6, dtype=torch.float64))
    old = torch.empty(6, dtype=torch.float64)
    vector.add(torch.full((6,), 10.0, dtype=torch.float64), old=old)
    assert old.tolist() == [1, 2, 3, 4, 5, 6]
    assert vector.read(out).tolist() == [11, 12, 13, 14, 15, 16]
    assert vector.bytes_sent == 2 * 6 * 8 and vector.remote_accumulates == 0  # one rank: all local
    vector.free()
    vector.free()  # safe twice
    assert live_handles() == before


def test_sharded_vector_rejects_tensors_it_cannot_move(MPI):
    vector = ShardedVector(MPI.COMM_SELF, 4, torch.float32)
    with pytest.raises(ValueError, match="expected a contiguous CPU torch.float32 tensor, got torch.float64"):
        vector.add(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        vector.read(torch.zeros(8)[::2])
    vector.free()


def test_counters(MPI):
    counters = Counters(MPI.COMM_SELF, 3)
    assert counters.read().tolist() == [0, 0, 0]
    assert [counters.fetch_add(0, 2) for _ in range(3)] == [0, 2, 4]
    counters.raise_to(1, 5)
    counters.raise_to(1, 3)  # a sticky maximum: lower values change nothing
    counters.set_all(np.array([7, counters.read()[1], 9]))
    assert counters.read().tolist() == [7, 5, 9]
    counters.free()
    counters.free()


def test_decision_board_stops_at_the_shared_lease_and_stays_stopped(MPI):
    """Rank 0 decides at its own question by freezing the shared lease: the first question no rank may
    have reached. Every question before it answers False (another rank may have answered it), every
    one from it True."""
    board = DecisionBoard(MPI.COMM_SELF)
    assert board.broadcast_flag(False, src=0, index=0) is False
    assert board.reduce_flag(False, all=True, index=1) is False
    lease = int(board.counters.read()[0])
    assert lease > 1, "the lease runs ahead of the questions asked"
    assert board.reduce_flag(True, all=True, index=2) is False, "decided, but not yet at the lease"
    assert board.stop_at == lease
    assert int(board.counters.read()[0]) == -(lease + 1), "the frozen lease is published"
    for index in range(3, lease):
        assert board.broadcast_flag(False, src=0, index=index) is False
    assert board.broadcast_flag(False, src=0, index=lease) is True
    assert board.reduce_flag(False, all=False, index=lease + 1) is True, "a stop stays decided"
    board.free()


def test_decision_board_a_rank_without_a_request_does_not_stop(MPI):
    board = DecisionBoard(MPI.COMM_SELF)
    assert not any(board.reduce_flag(False, all=False, index=i) for i in range(3 * DecisionBoard.LEASE))
    assert board.stop_at is None
    board.free()
