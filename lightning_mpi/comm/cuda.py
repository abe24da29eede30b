"""Is the MPI library CUDA-aware? Ask it, don't assume.

MPICH and Open MPI both export ``MPIX_Query_cuda_support()``: it answers at run time whether
device pointers may be passed to MPI calls. mpi4py does not wrap it, so it is looked up with
ctypes in the MPI library that mpi4py loaded. ``LIGHTNING_MPI_CUDA_AWARE=0|1`` overrides the
answer (for an MPI that lacks the query, or to force staging while debugging).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

ENV_OVERRIDE = "LIGHTNING_MPI_CUDA_AWARE"


def _loaded_mpi_libraries() -> list[str]:
    """Paths of MPI shared libraries mapped into this process (Linux /proc/self/maps)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


@lru_cache(maxsize=1)
def mpi_is_cuda_aware() -> bool:
    """True when the loaded MPI library accepts CUDA device buffers."""
    override = os.environ.get(ENV_OVERRIDE)
    if override is not None:
        return override.strip().lower() in ("1", "true", "yes", "on")
    from mpi4py import MPI  # noqa: F401  (loads the MPI library queried below; deferred: see lightning_mpi.comm)

    candidates = [None, *_loaded_mpi_libraries()]
    for path in candidates:
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        try:
            return bool(query())
        except Exception:  # a library that exports the symbol but cannot answer: assume not
            return False
    return False
