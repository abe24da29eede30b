"""The CUDA stream rules of the offload tiers, checked without a GPU: a recording stand-in for
``torch.cuda`` logs the order of stream calls around real (CPU) copies."""
from __future__ import annotations

import contextlib

import pytest
import torch

from lightning_mpi.offload.pool import HostBufferPool
from lightning_mpi.offload.streams import SideStreams
from lightning_mpi.offload.tensors import layout_of
from lightning_mpi.offload.tiers import CudaHostTier


class FakeEvent:
    def __init__(self, log, done=False, **_):
        self.log, self.done = log, done

    def record(self, stream):
        self.log.append(("record", stream.name))

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(("host waits", None))
        self.done = True


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append((f"{self.name} waits for", other.name))

    def wait_event(self, event):
        self.log.append((f"{self.name} waits for event", event))


class FakeCuda:
    """What :class:`SideStreams` uses of ``torch.cuda``; logs stream switches and allocations."""

    def __init__(self):
        self.log: list = []
        self.compute = FakeStream(self.log, "compute")
        self.current = self.compute
        self.events: list[FakeEvent] = []

    def Stream(self, device=None):  # noqa: N802 (torch.cuda's name)
        return FakeStream(self.log, "side")

    def Event(self, **kwargs):  # noqa: N802
        event = FakeEvent(self.log)
        self.events.append(event)
        return event

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        self.log.append(("enter", s.name))
        yield
        self.current = previous
        self.log.append(("leave", s.name))

    @contextlib.contextmanager
    def device(self, d):
        yield


class RecordingStreams(SideStreams):
    """SideStreams on the fake, logging ``record_stream`` and allocations (on CPU tensors)."""

    def _record(self, t, stream):
        self.cuda.log.append(("record_stream", stream.name))


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        cuda.log.append(("allocate on", cuda.current.name))
        kwargs["device"] = "cpu"
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return cuda


@pytest.mark.timeout(30)
def test_restore_is_allocated_on_the_compute_stream_and_copied_after_it(fake):
    streams = RecordingStreams(fake)
    src = torch.arange(64, dtype=torch.uint8)
    dev, _, end = streams.h2d(src, torch.device("cpu"))
    assert torch.equal(dev, src)
    log = fake.log
    alloc = log.index(("allocate on", "compute"))
    wait = log.index(("side waits for", "compute"))
    enter = log.index(("enter", "side"))
    assert alloc < wait < enter  # allocated outside the side stream, copy queued after compute
    assert ("record_stream", "side") in log[enter:]  # not reused under the copy
    log.clear()
    assert streams.hand_over(dev, end) is False  # the fake copy is still in flight: exposed
    assert log[0] == ("compute waits for event", end)


@pytest.mark.timeout(30)
def test_forward_back_pressure_waits_on_the_device_not_the_host(monkeypatch, fake):
    tier = CudaHostTier(HostBufferPool(pin_memory=False), max_inflight=2, cuda=fake)
    monkeypatch.setattr(tier, "_streams", RecordingStreams(fake))
    tensors = [torch.randn(1000) for _ in range(5)]
    tickets = [tier.swap_out(t, layout_of(t), t._version) for t in tensors]
    assert ("host waits", None) not in fake.log
    gates = [entry for entry in fake.log if entry[0] == "compute waits for event"]
    ends = [ticket.extra["written"] for ticket in tickets]
    assert [event for _, event in gates] == ends[:3]  # oldest first, down to max_inflight
    for ticket, t in zip(tickets, tensors):
        tier.fetch(ticket)
        assert torch.equal(tier.take(ticket), t)
