"""comm/mailbox: messages nobody waits for, on one rank (COMM_SELF: a rank may message itself).
The multi-rank behaviour is in test_comm_on_three_ranks.py."""

import pytest
import torch

from lightning_mpi.comm.mailbox import Mailbox
from lightning_mpi.comm.resources import live_handles
from lightning_mpi.comm.transport import CollectiveTimeout, Transport


class FailedPeers:
    """An error channel on which another rank has failed."""

    def check(self) -> None:
        raise RuntimeError("rank 1 failed")


def test_messages_arrive_in_order_into_the_reused_inbox_and_are_counted(MPI):
    before = live_handles()
    box = Mailbox(Transport(MPI.COMM_SELF, timeout=10), numel=3)
    assert live_handles()["comms"] == before["comms"] + 1, "a private communicator"
    first, second = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])
    box.send(0, first)
    box.send(0, second)
    message = box.wait_for_one()
    assert message is box.inbox, "every message lands in the one inbox"
    received = [message.clone()] + [m.clone() for m in box.arrived()]
    assert [r.tolist() for r in received] == [first.tolist(), second.tolist()]
    assert list(box.arrived()) == []
    assert box.sent_to == [2] and box.received_from == [2]
    box.finish_sends()
    box.close()
    box.close()  # safe twice
    assert box.comm is None and live_handles() == before


def test_reap_forgets_completed_sends(MPI):
    box = Mailbox(Transport(MPI.COMM_SELF, timeout=10), numel=2)
    box.send(0, torch.zeros(2))
    list(box.arrived())  # received: the send can complete
    box.finish_sends()
    box.reap()
    assert box._sending == []
    box.close()


def test_closing_with_messages_nobody_received_does_not_hang(MPI):
    box = Mailbox(Transport(MPI.COMM_SELF, timeout=10), numel=2)
    box.send(0, torch.ones(2))
    box.close()
    assert box.comm is None


def test_waiting_for_a_message_that_never_comes_times_out_naming_the_wait(MPI):
    box = Mailbox(Transport(MPI.COMM_SELF, timeout=0.05), numel=2)
    with pytest.raises(CollectiveTimeout, match=r"gossip drain on rank 0 waited more than 0.05 s"):
        box.wait_for_one()
    box.close()


def test_a_wait_raises_when_another_rank_failed(MPI):
    box = Mailbox(Transport(MPI.COMM_SELF, timeout=None, errors=FailedPeers()), numel=2)
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        box.wait_for_one()  # no timeout: only the error channel ends this wait
    box.close()
