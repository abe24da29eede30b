"""HostBufferPool: buffers reused across steps, busy ones only in stream order; size classes."""
from __future__ import annotations

import pytest

from lightning_mpi.offload.pool import HostBufferPool, size_class
from tests.offload.helpers import CUDA


@pytest.mark.timeout(30)
def test_host_buffer_pool_reuses_buffers_across_steps():
    # The size pattern of a real step (a few repeated activation sizes), five times over.
    sizes = [262144, 262144, 131072, 98304, 262144, 5000, 131072]
    pool = HostBufferPool(pin_memory=CUDA)
    reserved = []
    for _ in range(5):
        lent = [pool.acquire(n) for n in sizes]
        assert all(buf.numel() >= n for buf, n in zip(lent, sizes))
        for buf in lent:
            pool.release(buf)
        stats = pool.stats()
        assert stats.in_use_bytes == 0
        reserved.append((stats.reserved_bytes, stats.allocations))
    assert reserved == [reserved[0]] * 5
    assert reserved[0][0] == sum(size_class(n) for n in sizes)
    pool.clear()
    assert pool.stats().reserved_bytes == 0


class _PendingEvent:
    """Stands in for a CUDA event whose copy has not finished."""

    done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.mark.timeout(30)
def test_host_buffer_pool_reuses_a_busy_buffer_only_in_stream_order():
    pool = HostBufferPool(pin_memory=False)
    side, other = object(), object()  # stand-ins for two CUDA streams
    buf = pool.acquire(100_000, stream=side)
    event = _PendingEvent()
    pool.release(buf, after=event, stream=side)  # an h2d copy on `side` still reads it
    assert pool.acquire(100_000) is not buf  # the host must not write into it
    assert pool.acquire(100_000, stream=other) is not buf  # nor a copy on another stream
    assert pool.acquire(100_000, stream=side) is buf  # a copy queued behind it on `side` may
    assert pool.stats().allocations == 3
    event.done = True


@pytest.mark.timeout(30)
def test_size_classes_waste_at_most_an_eighth():
    for n in [1, 4095, 4097, 10**5, 3 * 2**20 + 1, 2**30 - 3]:
        cls = size_class(n)
        assert n <= cls and (cls <= 4096 or cls - n < cls / 8)


@pytest.mark.timeout(30)
def test_pinned_size_classes_are_what_torch_reserves():
    # torch's pinned allocator rounds each block up to a power of two: the pool's classes match
    for n in [1, 4097, 10**5, 3 * 2**20 + 1, 17 * 2**20]:
        cls = size_class(n, pinned=True)
        assert n <= cls < 2 * max(n, 4096) and cls & (cls - 1) == 0
    assert size_class(17 * 2**20, pinned=True) == 32 * 2**20


@pytest.mark.timeout(30)
def test_clear_returns_pinned_memory_to_the_driver(monkeypatch):
    import lightning_mpi.offload.pool as pool_module

    calls = []
    monkeypatch.setattr(pool_module, "return_cached_pinned_memory", lambda: calls.append(1))
    pageable = HostBufferPool(pin_memory=False)
    pageable.release(pageable.acquire(5000))
    pageable.clear()
    assert calls == []
    pinned = HostBufferPool(pin_memory=False)
    pinned.release(pinned.acquire(5000))
    pinned.pin_memory = True  # clear() of a pinned pool, without allocating pinned memory here
    pinned.clear()
    assert calls == [1] and pinned.stats().reserved_bytes == 0
