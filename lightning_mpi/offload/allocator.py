"""Make glibc hand freed activation memory back to the OS (CPU-only disk offload).

Offloading activations to disk lowers peak RSS only if the memory they held leaves the process
when they are freed; glibc's default keeps it in its heap. Process-wide, applied once.
"""

from __future__ import annotations

import ctypes
import os
import sys

_MALLOPT_DONE = False
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_freed_memory_to_os(threshold: int) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes and more with ``mmap``, so that
    freeing one returns its memory to the OS at once. Returns whether the setting was applied.

    Why: by default glibc raises its mmap threshold after the first large free, and from then on
    serves activation-sized tensors from its heap, which keeps freed memory (peak RSS includes
    every hole). Offloaded activations are freed in the middle of forward; without this their
    memory stays in the heap and peak RSS does not drop (measured: a 3D U-Net step peaked
    *higher* with offloading than without, until this was set). Process-wide, once. Left alone
    where the user chose a threshold (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``) and
    where the C library is not glibc (jemalloc or tcmalloc return memory on their own).
    """
    global _MALLOPT_DONE
    if _MALLOPT_DONE:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (raises AttributeError where libc is not glibc)
        applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
    except (OSError, AttributeError):
        return False
    _MALLOPT_DONE = applied
    return applied
