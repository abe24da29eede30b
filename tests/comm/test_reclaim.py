"""comm/reclaim: a failed run's mailboxes settled and its windows and communicators freed on the
next run's fresh transport (one rank here; three in test_comm_on_three_ranks.py)."""

import torch

from lightning_mpi.comm.mailbox import Mailbox
from lightning_mpi.comm.reclaim import reclaim
from lightning_mpi.comm.resources import RunResources, live_handles
from lightning_mpi.comm.transport import Transport
from lightning_mpi.comm.window import Counters, ShardedVector


class NoCollectives:
    """A transport that must not be used."""

    def agree(self, obj):
        raise AssertionError("reclaim([]) made a collective")


def test_nothing_to_reclaim_makes_no_collective():
    assert reclaim([], NoCollectives()) == []


def test_an_abandoned_run_is_settled_and_freed(MPI):
    before = live_handles()
    failed = RunResources(serial=1)
    transport = Transport(failed.comm(MPI.COMM_SELF.Dup()), timeout=10, resources=failed)
    box = Mailbox(transport, numel=4)
    box.send(0, torch.ones(4))
    box.send(0, torch.full((4,), 2.0))  # neither is received before the run fails
    vector = ShardedVector(MPI.COMM_SELF, 4, torch.float64, resources=failed)
    counters = Counters(MPI.COMM_SELF, 2, resources=failed)
    assert failed.counts() == (1, 4, 2, 1)
    failed.abandon()
    box.close()  # no-ops now: the run's handles wait for the next run
    vector.free()
    counters.free()
    assert failed.counts() == (1, 4, 2, 1) and box.received_from == [0]
    assert reclaim([failed], Transport(MPI.COMM_SELF, timeout=10)) == []
    assert box.received_from == [2], "every message sent to this rank was received and dropped"
    assert failed.counts() == (1, 0, 0, 0) and live_handles() == before
