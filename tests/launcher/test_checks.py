"""Tests of :mod:`lightning_mpi.launcher.checks`: flavor detection, the mpiexec lookup, and the
MPI checks failing through ``main()`` with exit code 2 and a message naming the problem and the fix.
"""
from __future__ import annotations

import re
import sys

import pytest

from lightning_mpi.launcher import cli
from lightning_mpi.launcher.checks import (
    check_mpi4py,
    check_mpi_match,
    find_mpiexec,
    flavor_from_version,
    mpiexec_version,
)
from lightning_mpi.launcher.errors import LaunchError
from tests.launcher.helpers import VENV_MPIEXEC, fake_launcher, needs_venv_mpiexec, run_main


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text, flavor",
    [
        ("HYDRA build details:\n    Version: 4.2.0", "mpich"),
        ("MPICH Version:      5.0.2\nMPICH ABI: 18:2:6", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
        ("MVAPICH2 Version      :\t2.3.7", "mpich"),
        ("mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
        ("mpiexec (OpenRTE) 4.0.3", "openmpi"),
        ("prterun (PRRTE) 3.0.2", "openmpi"),
        ("Open MPI v5.0.3, package: Open MPI builder, ident: 5.0.3", "openmpi"),
        ("slurm 23.02.7", "srun"),
        ("FooMPI 1.0: supported, short, reported", None),
        ("", None),
    ],
)
def test_flavor_from_version(text, flavor):
    assert flavor_from_version(text) == flavor


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_venv_mpiexec_is_found_first_and_is_mpich():
    found = find_mpiexec()
    assert found == str(VENV_MPIEXEC)
    assert flavor_from_version(mpiexec_version(found)) == "mpich"


@pytest.mark.timeout(10)
def test_find_mpiexec_explicit_name_on_path(tmp_path):
    fake = fake_launcher(tmp_path, "my-mpirun", "mpirun (Open MPI) 4.1.6")
    assert find_mpiexec("my-mpirun", environ={"PATH": str(tmp_path)}) == str(fake)
    assert find_mpiexec(str(fake)) == str(fake)
    with pytest.raises(LaunchError, match="argument --mpiexec: 'nope'"):
        find_mpiexec("nope", environ={"PATH": str(tmp_path)})


@pytest.mark.timeout(30)
def test_mpi_mismatch_names_the_mpiexec_and_the_fix(capsys, tmp_path, script):
    fake = fake_launcher(tmp_path, "mpirun", "mpirun (Open MPI) 4.1.6")
    code, _, err = run_main(capsys, ["-n", "2", "--mpiexec", fake, "--dry-run", script])
    assert code == 2
    assert f"the mpiexec found, {fake}, is Open MPI" in err
    assert "mpi4py uses MPICH" in err
    assert "fix: pip install mpich" in err and "--mpiexec PATH" in err


@pytest.mark.timeout(30)
def test_mismatch_found_on_path_without_venv_mpiexec(capsys, monkeypatch, tmp_path, script):
    # Without a venv mpiexec, PATH decides; an Open MPI mpirun there must be refused.
    fake_launcher(tmp_path, "mpiexec", "mpiexec (OpenRTE) 4.0.3")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cli, "check_mpi4py", lambda python=None: "MPICH Version: 5.0.2")
    code, _, err = run_main(capsys, ["-n", "2", "--dry-run", script])
    assert code == 2
    assert f"the mpiexec found, {tmp_path / 'mpiexec'}, is Open MPI" in err


@pytest.mark.timeout(30)
def test_unknown_mpiexec_flavor(capsys, tmp_path, script):
    fake = fake_launcher(tmp_path, "mpiexec", "FooMPI launcher 1.0")
    code, _, err = run_main(capsys, ["-n", "2", "--mpiexec", fake, script])
    assert code == 2
    assert f"cannot tell which MPI {fake} belongs to" in err and "fix: pass --mpiexec PATH" in err


@pytest.mark.timeout(10)
def test_check_mpi_match_directly():
    assert check_mpi_match("MPICH Version: 5.0.2", "mpiexec", "mpich") == []
    assert check_mpi_match("Open MPI v5.0.3", "mpirun", "openmpi") == []
    assert check_mpi_match("Open MPI v5.0.3", "srun", "srun") == []
    with pytest.raises(LaunchError, match="fix: pass --mpiexec PATH of Open MPI's mpirun"):
        check_mpi_match("Open MPI v5.0.3", "/usr/bin/mpiexec", "mpich")
    warnings = check_mpi_match("Exotic MPI 1.0", "mpiexec", "mpich")
    assert len(warnings) == 1 and "Exotic MPI 1.0" in warnings[0]


SHADOW_NO_MPI4PY = "raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n"
SHADOW_NO_LIBMPI = "import types\nrc = types.SimpleNamespace()\n__version__ = '0'\n"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "init, mpi, message",
    [
        (SHADOW_NO_MPI4PY, None, r"mpi4py does not import in .*No module named 'mpi4py'.*fix: pip install mpi4py"),
        (SHADOW_NO_LIBMPI, "raise ImportError('libmpi.so.12: cannot open shared object file')\n",
         r"MPI library does not load in .*libmpi\.so\.12.*fix: pip install mpich"),
    ],
)
def test_mpi4py_check_failures(capsys, monkeypatch, tmp_path, script, init, mpi, message):
    # A package earlier on PYTHONPATH shadows the real mpi4py in the probe subprocess.
    shadow = tmp_path / "shadow" / "mpi4py"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(init)
    if mpi is not None:
        (shadow / "MPI.py").write_text(mpi)
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    code, _, err = run_main(capsys, ["-n", "2", "--dry-run", script])
    assert code == 2
    assert re.search(message, err), err


@pytest.mark.timeout(30)
def test_check_mpi4py_reports_the_library():
    assert flavor_from_version(check_mpi4py()) == "mpich"
