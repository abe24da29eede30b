"""Tests of lightning_mpi.comm.mpienv: Open MPI's one-sided component chosen before MPI starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_mpi.comm.mpienv import apply_mpi_defaults, mpi_defaults, rdma_devices
from tests.mpi_utils import REPO


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "environ, devices, chosen",
    [
        ({}, [], {"OMPI_MCA_osc": "^ucx"}),  # no RDMA device: leave osc/ucx out, no error line
        ({}, ["mlx5_0"], {}),  # an InfiniBand/RoCE device that osc/ucx would use: Open MPI's choice
        ({"OMPI_MCA_osc": "rdma"}, [], {}),  # the user's choice wins
        ({"OMPI_MCA_osc_ucx_tls": "any"}, [], {}),
        ({"OMPI_MCA_opal_common_ucx_devices": "any"}, [], {}),
        ({"OMPI_MCA_pml": "ob1"}, ["efa0"], {"OMPI_MCA_osc": "^ucx"}),  # other settings do not count
    ],
)
def test_defaults_leave_ucx_out_only_where_it_cannot_serve(environ, devices, chosen):
    assert mpi_defaults(environ, devices) == chosen


@pytest.mark.timeout(10)
def test_apply_sets_what_it_chose(tmp_path):
    environ: dict[str, str] = {}
    chosen = apply_mpi_defaults(environ)
    assert environ == chosen
    assert rdma_devices(str(tmp_path / "none")) == []


@pytest.mark.timeout(60)
def test_import_lightning_mpi_sets_it_before_mpi_starts():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    env["PYTHONPATH"] = str(REPO)
    code = (
        "import os, lightning_mpi, sys\n"
        "from lightning_mpi.comm.mpienv import APPLIED\n"
        "print(os.environ.get('OMPI_MCA_osc'), APPLIED, 'mpi4py.MPI' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    has_mlx = any(d.startswith("mlx") for d in rdma_devices())
    expected = "None {} False" if has_mlx else "^ucx {'OMPI_MCA_osc': '^ucx'} False"
    assert out.stdout.strip() == expected
