"""Settings that MPI reads from the environment when it initialises, chosen before the first
``from mpi4py import MPI`` (``import lightning_mpi`` applies them: :func:`apply_mpi_defaults`).

Standard library only: it runs on ``import lightning_mpi``, which must stay fast.

Open MPI's one-sided component. Open MPI 5 tries its UCX one-sided component (``osc/ucx``) first
at the first window creation. That component is meant for RDMA networks (its defaults accept only
the UCX transports of Mellanox/NVIDIA devices, ``osc_ucx_devices=mlx*``); on a machine without
one, its query fails and every rank prints

    osc_ucx_component.c:375  Error: OSC UCX component priority set inside component query failed

before Open MPI falls back to the next component (``osc/sm`` on one node, ``osc/rdma`` across
nodes). The line is harmless but reads like a failure, so where no such device exists
(``/sys/class/infiniband/mlx*``), ``OMPI_MCA_osc=^ucx`` leaves the UCX component out and Open
MPI picks the same fallback directly, without the line. Measured on a 2-core machine without
InfiniBand (``benchmarks/osc_choice.py``): ``osc/sm`` is selected either way and one-sided
commits take the same time. A user's own choice wins: nothing is set when any
``OMPI_MCA_osc*`` or UCX selection variable is set already (``mpiexec --mca osc ...`` sets
``OMPI_MCA_osc`` too). MPICH ignores ``OMPI_MCA_*`` variables.

Each process decides for its own host, when it imports lightning_mpi before ``mpi4py.MPI``. The
ranks of a one-machine ``lightning-mpi`` job inherit the launcher's choice (it imports
lightning_mpi too), whatever their import order; with ``--hosts`` / ``--hostfile`` the launcher
does not pass it on (:data:`APPLIED`), since Open MPI forwards ``OMPI_MCA_*`` variables to every
host and a compute node may have the devices that the launching node lacks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping

__all__ = ["APPLIED", "apply_mpi_defaults", "mpi_defaults", "rdma_devices"]

#: Where Linux lists RDMA devices (InfiniBand, RoCE), and the names that Open MPI's UCX
#: components accept by default (their ``*_ucx_devices`` parameter is ``mlx*``).
RDMA_CLASS_DIR = "/sys/class/infiniband"
UCX_DEVICE_PREFIX = "mlx"

#: What :func:`apply_mpi_defaults` set in ``os.environ`` of this process.
APPLIED: dict[str, str] = {}

#: Variables through which a user chooses Open MPI's one-sided component or UCX's devices.
_USER_CHOICES = ("OMPI_MCA_osc", "OMPI_MCA_opal_common_ucx")


def rdma_devices(directory: str = RDMA_CLASS_DIR) -> list[str]:
    """Names of the RDMA devices of this machine (``[]`` when there are none)."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def mpi_defaults(environ: MutableMapping[str, str], devices: Iterable[str]) -> dict[str, str]:
    """The variables to set in ``environ`` before MPI initialises (pure; module docstring):
    ``{"OMPI_MCA_osc": "^ucx"}`` when no device of ``devices`` is one UCX's one-sided component
    would use and the user chose nothing, else ``{}``."""
    if any(key.startswith(_USER_CHOICES) for key in environ):
        return {}
    if any(name.startswith(UCX_DEVICE_PREFIX) for name in devices):
        return {}
    return {"OMPI_MCA_osc": "^ucx"}


def apply_mpi_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :func:`mpi_defaults` in ``environ`` (default ``os.environ``) and return what was set.

    Effective only before MPI initialises in this process (the first ``from mpi4py import MPI``);
    the ranks of a job inherit nothing from it, each applies it when it imports lightning_mpi.
    """
    target = os.environ if environ is None else environ
    chosen = mpi_defaults(target, rdma_devices())
    target.update(chosen)
    if environ is None:
        APPLIED.update(chosen)
    return chosen
