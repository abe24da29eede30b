"""return_freed_memory_to_os: glibc's mmap threshold, set once and never over the user's choice."""
from __future__ import annotations

import pytest


@pytest.mark.timeout(30)
def test_allocator_setting_respects_the_users_own(monkeypatch):
    import lightning_mpi.offload.allocator as allocator

    monkeypatch.setattr(allocator, "_MALLOPT_DONE", False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.return_freed_memory_to_os(1 << 20) is False  # the user chose: left alone
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert allocator.return_freed_memory_to_os(1 << 20) is False
    assert allocator._MALLOPT_DONE is False


@pytest.mark.timeout(30)
def test_huge_pages_are_recognised_from_either_setting(monkeypatch):
    from lightning_mpi.offload.hooks import _huge_pages_asked

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert not _huge_pages_asked()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert not _huge_pages_asked()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert _huge_pages_asked()
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1")
    assert _huge_pages_asked()
