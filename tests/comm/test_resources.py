"""comm/resources: what one run made over MPI, freed one by one while the run is healthy, kept
whole once it was abandoned (single process, on duplicates of COMM_SELF)."""

import gc
import weakref

import pytest

from lightning_mpi.comm.resources import RunResources, keep_pending, live_handles


def test_tracked_handles_are_counted_and_freed_once(MPI):
    before = live_handles()
    run = RunResources(serial=3)
    comm = run.comm(MPI.COMM_SELF.Dup())
    win = run.window(MPI.Win.Allocate(8, 8, comm=comm))
    assert live_handles() == {"comms": before["comms"] + 1, "windows": before["windows"] + 1}
    assert run.counts() == (3, 1, 1, 0)
    run.free_window(win)
    run.free_comm(comm)
    run.free_comm(comm)  # already freed: nothing happens (a second Free would be an MPI error)
    assert live_handles() == before and run.counts() == (3, 0, 0, 0)


def test_an_abandoned_run_frees_nothing_until_free_abandoned(MPI):
    before = live_handles()
    run = RunResources(serial=1)
    comm = run.comm(MPI.COMM_SELF.Dup())
    win = run.window(MPI.Win.Allocate(8, 8, comm=comm))
    box = object()
    run.mailbox(box)  # any object: the registry only keeps it
    run.abandon()
    run.free_window(win)
    run.free_comm(comm)
    assert not run.forget_mailbox(box)
    assert run.counts() == (1, 1, 1, 1), "an abandoned run keeps every handle for reclaim"
    assert live_handles()["comms"] == before["comms"] + 1
    run.free_abandoned()
    assert run.counts() == (1, 0, 0, 0) and live_handles() == before
    assert comm == MPI.COMM_NULL and win == MPI.WIN_NULL, "freed by free_abandoned"


def test_free_abandoned_refuses_a_live_run(MPI):
    run = RunResources()
    comm = run.comm(MPI.COMM_SELF.Dup())
    with pytest.raises(RuntimeError, match="free_abandoned\\(\\) is for abandoned runs"):
        run.free_abandoned()
    run.free_comm(comm)


def test_a_live_mailbox_may_close_and_is_forgotten():
    run = RunResources()
    box = object()
    run.mailbox(box)  # any object: the registry only keeps it
    assert run.forget_mailbox(box)
    assert run.mailboxes == []


def test_keep_pending_keeps_a_request_and_its_buffers_alive():
    class Request:
        pass

    request = Request()
    ref = weakref.ref(request)
    keep_pending(request)
    del request
    gc.collect()
    assert ref() is not None, "MPI may still write into its buffers: it must outlive the run"
