"""Every rank joins the same collectives in mpi_auto's measurements, whatever its own clock or state
says (issue 25: a rank that decided from its own timing how often to time an exchange hung the
job). One rank's view of a 2-rank job, the other rank scripted; on ranks: tests/strategies/test_auto.py."""
from __future__ import annotations

import pytest
import torch

from lightning_mpi.rules.auto.arms import average_optimizer_state
from lightning_mpi.rules.link import LinkProbe


class OtherRank:
    """Rank 0 of 2: an agreement (a float64 Allreduce "max") meets the other rank's scripted values;
    every collective is recorded."""

    size, rank, timeout = 2, 0, None

    def __init__(self, peer=(), peer_entries=()):
        self.peer = [list(v) for v in peer]
        self.peer_entries = list(peer_entries)
        self.calls: list[str] = []

    def barrier(self):
        self.calls.append("barrier")

    def allreduce_(self, tensor, op="sum"):
        if tensor.dtype == torch.float64:
            self.calls.append(f"agree{tensor.numel()}")
            tensor.copy_(torch.maximum(tensor, torch.tensor(self.peer.pop(0), dtype=torch.float64)))
        else:
            self.calls.append(f"allreduce{tensor.numel()}")
        return tensor

    def allgather_object(self, obj):
        self.calls.append("allgather")
        return [obj, self.peer_entries]


def test_how_often_an_exchange_is_timed_is_agreed_not_local():
    # The other rank waited 0.5 s for a late rank in its first tiny Allreduce: it times that once,
    # so this rank (fast locally) must too; the big exchange was fast everywhere: three times.
    # Before the fix this rank timed the tiny one three times, and the ranks' Allreduces no longer matched.
    link = OtherRank(peer=[[0.5], [0.001], [0.1, 0.5, 0.01]])
    big = torch.zeros(1000)
    measured = LinkProbe(link).measure(0.05, lambda: link.allreduce_(big), 4000)
    assert link.calls == ["barrier", "allreduce1", "agree1", "allreduce1000", "agree1", "allreduce1000",
                          "allreduce1000", "agree3"]
    assert measured.step_seconds == pytest.approx(0.1) and measured.link.latency > 0
    assert not link.peer  # every scripted agreement was used


def test_fast_everywhere_times_three_times_slow_anywhere_once():
    link = OtherRank(peer=[[0.0], [0.0], [0.0, 0.0, 0.0]])
    LinkProbe(link, repeat_below=0.25).measure(0.05, lambda: link.allreduce_(torch.zeros(8)), 32)
    assert link.calls.count("allreduce1") == 3 and link.calls.count("allreduce8") == 3
    link = OtherRank(peer=[[0.0], [9.0], [0.0, 0.0, 0.0]])  # the big exchange was slow on the other rank
    LinkProbe(link, repeat_below=0.25).measure(0.05, lambda: link.allreduce_(torch.zeros(8)), 32)
    assert link.calls.count("allreduce1") == 3 and link.calls.count("allreduce8") == 1


def test_optimizer_state_averaged_only_where_every_rank_holds_it():
    # This rank stepped parameters 0 and 1 (SGD momentum); the other rank never got a gradient for
    # parameter 1 (no state there). Only parameter 0's buffer is averaged, by every rank alike.
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:  # as one step with gradients of ones leaves it
        optimizer.state[p]["momentum_buffer"] = torch.ones_like(p)
    link = OtherRank(peer_entries=[(0, "momentum_buffer")])
    average_optimizer_state(link, params, optimizer)  # type: ignore[arg-type]
    assert link.calls == ["allgather", "allreduce3"]
    assert torch.equal(optimizer.state[params[0]]["momentum_buffer"], torch.full((3,), 0.5))  # the fake sum: own 1, / 2
    assert torch.equal(optimizer.state[params[1]]["momentum_buffer"], torch.ones(2))  # left as this rank's own
