"""OffloadSession: which saved tensors leave, in which order they come back, what is released."""
from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from lightning_mpi.offload.disk import DiskTier
from lightning_mpi.offload.session import OffloadSession


class RecordingTier(DiskTier):
    """A disk tier that records the order of swap-outs, fetches and takes, and the prefetch
    depth."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out, self.fetched, self.taken, self.max_ahead = [], [], [], 0
        self.waited = []  # taken without having been fetched ahead

    def swap_out(self, tensor, layout, version):
        ticket = super().swap_out(tensor, layout, version)
        ticket.extra["index"] = len(self.out)
        self.out.append(ticket)
        return ticket

    def fetch(self, ticket):
        if ticket.read is None and not ticket.done:
            self.fetched.append(ticket.extra["index"])
        super().fetch(ticket)
        ahead = sum(1 for t in self.out if t.read is not None and not t.done)
        self.max_ahead = max(self.max_ahead, ahead)

    def take(self, ticket):
        self.taken.append(ticket.extra["index"])
        if ticket.read is None:
            self.waited.append(ticket.extra["index"])
        return super().take(ticket)


def _chain_session(tmp_path, n, keep_last, prefetch, tiers, nbytes=16384):
    """n ops that each save a distinct tensor of nbytes, through a session on a recording tier."""
    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=nbytes, keep_last=keep_last, prefetch=prefetch)
    session.start(set())
    x = torch.randn(nbytes // 4, requires_grad=True)
    with saved_tensors_hooks(session.pack, session.unpack):
        h = x
        for _ in range(n):
            h = (h * 0.5).exp()  # exp saves its output: one new tensor per op
        loss = h.sum()
    return tier, session, x, loss


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep_last, prefetch", [(0, 1), (2, 3), (4, 0)])
def test_keep_last_window_and_prefetch_in_backward_order(tmp_path, keep_last, prefetch, tiers):
    n = 10
    tier, session, x, loss = _chain_session(tmp_path, n, keep_last, prefetch, tiers)
    assert len(tier.out) == n - keep_last  # the last keep_last saved tensors stayed resident
    session.begin_backward()
    assert tier.fetched == list(range(n - keep_last - 1, n - keep_last - 1 - prefetch, -1))  # ahead of use
    loss.backward()
    backward_order = list(range(n - keep_last - 1, -1, -1))
    assert tier.taken == backward_order
    assert tier.fetched == backward_order  # prefetch 0: each one fetched when backward asks
    assert tier.max_ahead <= max(prefetch, 1)
    stats = session.finish()
    assert stats.offloaded_tensors == n - keep_last
    assert stats.peak_saved_bytes == (n - keep_last) * 16384


@pytest.mark.timeout(30)
def test_a_graph_dropped_without_backward_releases_its_copies(tmp_path, tiers):
    tier, session, x, loss = _chain_session(tmp_path, 6, keep_last=0, prefetch=2, tiers=tiers)
    session.begin_backward()  # two reads are now in flight
    assert len(tier.out) == 6 and sum(t.read is not None for t in tier.out) == 2
    del loss  # the graph, and with it every handle, goes away
    assert all(t.done and t.read is None for t in tier.out)  # copies and prefetches released
    stats = session.finish()
    assert stats.offloaded_tensors == 6


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep_last", [0, 5])
def test_in_place_change_after_saving_raises_like_autograd(tmp_path, keep_last, tiers):
    tier = DiskTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=1024, keep_last=keep_last, prefetch=1)
    session.start(set())
    x = torch.randn(1024, requires_grad=True)
    with saved_tensors_hooks(session.pack, session.unpack):
        y = (x * 1).exp()
        z = (y * 2).sum()
        y.add_(1)  # exp needs its output in backward
    with pytest.raises(RuntimeError, match="modified in place"):
        z.backward()
    session.abort()


def exp_chain(h, n):
    """n steps of ``exp(0.5 h)``: each saves one tensor for backward."""
    for _ in range(n):
        h = (h * 0.5).exp()
    return h


@pytest.mark.timeout(30)
def test_reentrant_checkpoint_recomputation_keeps_prefetching_the_forward_pass(tmp_path, tiers):
    """A reentrant checkpoint recomputes its segment inside backward, and that recomputation saves
    tensors: they are used at once (kept resident), and backward goes on prefetching the tensors
    of the forward pass instead of starting a new one."""
    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=16384, keep_last=0, prefetch=2)
    session.start(set())
    x = torch.randn(4096, requires_grad=True)

    with saved_tensors_hooks(session.pack, session.unpack):  # as in a training step: backward too
        h = exp_chain(x, 4)
        h = checkpoint(exp_chain, h, 3, use_reentrant=True)  # saves only its input (already saved)
        loss = exp_chain(h, 4).sum()
        assert len(tier.out) == 8
        session.begin_backward()
        loss.backward()
    assert len(tier.out) == 8  # nothing recomputed was offloaded
    assert tier.taken == list(range(7, -1, -1))
    assert tier.waited == []  # every offloaded tensor was prefetched ahead of use
    stats = session.finish()
    assert stats.offloaded_tensors == 8


@pytest.mark.timeout(30)
def test_views_that_are_not_dense_stay_resident_with_their_strides(tmp_path, tiers):
    """A strided slice shares memory with its base: a copy of it would free nothing while the
    base lives, and would come back contiguous, with other strides than backward saw in forward."""
    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=1024, keep_last=0, prefetch=1)
    session.start(set())
    x = torch.randn(64, 128, requires_grad=True)
    h = x * 1
    view = h[:, ::2]
    back = session.unpack(session.pack(view))
    assert back.stride() == view.stride() and torch.equal(back, view)
    with saved_tensors_hooks(session.pack, session.unpack):
        loss = (x * 1)[:, ::2].sin().sum()  # sin saves its input: the view
        loss.backward()
    assert tier.out == []
    expected = torch.zeros_like(x)
    expected[:, ::2] = x.detach()[:, ::2].cos()
    assert torch.equal(x.grad, expected)
    stats = session.finish()
    assert stats.offloaded_tensors == 0 and stats.resident_bytes >= 2 * 64 * 64 * 4


@pytest.mark.timeout(30)
def test_a_saved_tensor_that_is_never_unpacked_does_not_stall_the_prefetch(tmp_path, tiers):
    """A branch the loss does not use keeps its saved tensors alive, never unpacked, as long as
    its output lives. Once backward has gone past one, its prefetch slot goes back to the
    window: it costs at most one tensor fetched on demand, not every one after it."""
    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=16384, keep_last=0, prefetch=1)
    session.start(set())
    x = torch.randn(4096, requires_grad=True)

    with saved_tensors_hooks(session.pack, session.unpack):
        h = exp_chain(x, 5)  # saves 0..4
        unused = (h * 0.3).exp()  # saves 5, an output nobody differentiates
        loss = exp_chain(h, 4).sum()  # saves 6..9
        session.begin_backward()
        loss.backward()
    assert tier.taken == [9, 8, 7, 6, 4, 3, 2, 1, 0]
    assert 5 in tier.fetched and len(tier.waited) <= 1, tier.waited
    assert tier.max_ahead <= 2  # the window, plus the passed-over tensor until its graph goes
    del unused
    stats = session.finish()
    assert stats.offloaded_tensors == 10


@pytest.mark.timeout(30)
def test_tensors_saved_during_cuda_graph_capture_stay_resident(tmp_path, tiers, monkeypatch):
    """What a CUDA graph captures is replayed without the offload's copies and waits: tensors
    saved during capture stay where they are, counted so the callback can say so. (Capture needs
    a GPU; here the capture check is stood in for.)"""
    import lightning_mpi.offload.session as session_module

    tier = RecordingTier(str(tmp_path), max_inflight=1)
    tiers.append(tier)
    session = OffloadSession(tier, lambda t: True, min_bytes=1024, keep_last=0, prefetch=1)
    session.start(set())
    x = torch.randn(4096, requires_grad=True)
    monkeypatch.setattr(session_module, "_in_cuda_graph_capture", lambda t: True)
    with saved_tensors_hooks(session.pack, session.unpack):
        loss = (x * 0.5).exp().exp().sum()
        loss.backward()
    assert tier.out == []
    stats = session.finish()
    assert stats.captured_tensors == 2 and stats.offloaded_tensors == 0


class _Marker:
    """Stands in for a compute-stream event: done when the test says the device got there."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


class _DeviceTier:
    """A tier that keeps tensors in memory and hands out device-use markers the test completes."""

    def __init__(self):
        self.fetched: list[int] = []
        self.markers: list[_Marker] = []

    def swap_out(self, tensor, layout, version):
        from lightning_mpi.offload.tiers import Ticket

        ticket = Ticket(layout, version)
        ticket.buf = tensor
        return ticket

    def fetch(self, ticket):
        if ticket.order not in self.fetched:
            self.fetched.append(ticket.order)

    def take(self, ticket):
        self.fetch(ticket)
        ticket.done = True
        return ticket.buf

    def used_marker(self, ticket):
        self.markers.append(_Marker())
        return self.markers[-1]

    def discard(self, ticket):
        ticket.done = True

    def end_step(self):
        from lightning_mpi.offload.tiers import TierStats

        return TierStats()


@pytest.mark.timeout(30)
def test_prefetch_is_paced_by_the_device_not_by_the_host():
    """Restored tensors count in the prefetch window until the device has used them: while the
    device lags, the host fetches nothing more; once it catches up, prefetching resumes."""
    tier = _DeviceTier()
    session = OffloadSession(tier, lambda t: True, min_bytes=1, keep_last=0, prefetch=2)
    session.start(set())
    packed = []

    def pack(t):
        packed.append(session.pack(t))
        return packed[-1]

    x = torch.randn(64, requires_grad=True)
    with saved_tensors_hooks(pack, session.unpack):
        h = x
        for _ in range(8):
            h = h.exp()  # saves its result: one offloaded tensor per layer, orders 0..7
    session.begin_backward()
    assert tier.fetched == [7, 6]
    for order in (7, 6, 5):  # backward walks on; the device runs none of it yet
        session.unpack(packed[order])
    # 7 taken: 5 fetched (the consumer of 7 is the one running now). 6 and 5 taken: the window
    # holds 7 and 6, whose consumers the device has not run: no prefetch.
    assert tier.fetched == [7, 6, 5]
    for marker in tier.markers:
        marker.done = True  # the device has run the consumers of 7 and 6
    session.unpack(packed[4])
    assert tier.fetched == [7, 6, 5, 4, 3]  # the window refills
    session.finish()
