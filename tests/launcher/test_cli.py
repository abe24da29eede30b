"""Tests of :mod:`lightning_mpi.launcher.cli`: argument errors (exit code 2, the bad argument and
the fix on stderr), dry runs (the command, the topology, the launcher chosen, no launch), the
entry points, and a launcher that imports nothing heavy.
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lightning_mpi.launcher import cli
from tests.launcher.helpers import (
    RANK_SCRIPT,
    VENV_MPIEXEC,
    fake_launcher,
    finish,
    launch,
    needs_venv_mpiexec,
    run_main,
    standalone,
    write,
)
from tests.mpi_utils import REPO


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", "S"], r"argument -n/-np/--np: '0' is not an integer >= 1"),
        (["-n", "two", "S"], r"argument -n/-np/--np: 'two' is not an integer >= 1"),
        (["S"], r"the following arguments are required: -n"),
        (["-n", "2", "--ppn", "0", "S"], r"argument --ppn: '0'"),
        (["-n", "2", "--env", "NOVALUE", "S"], r"argument --env: 'NOVALUE' is not KEY=VALUE.*example"),
        (["-n", "2", "--env", "1A=2", "S"], r"argument --env: '1A=2'"),
        (["-n", "2", "--hosts", "a:0", "S"], r"argument --hosts: slots of host 'a'.*example"),
        (["-n", "2", "--hosts", "a", "--hostfile", "f", "S"], r"argument --hostfile: not allowed with argument --hosts"),
        (["-n", "2", "missing.py"], r"argument script: 'missing.py' not found.*fix:"),
        (["-n", "2", "--hostfile", "nofile", "S"], r"argument --hostfile: cannot read 'nofile'"),
        (["-n", "2", "--hosts", "localhost,no-such-host.invalid", "S"],
         r"host does not resolve: 'no-such-host.invalid'.*fix: correct the name"),
        (["-n", "2", "--mpiexec", "/nonexistent/mpiexec", "S"], r"argument --mpiexec: '/nonexistent/mpiexec'.*fix:"),
    ],
)
def test_argument_errors(capsys, script, argv, message):
    code, out, err = run_main(capsys, [str(script) if a == "S" else a for a in argv])
    assert code == 2
    assert out == ""
    assert err.startswith("usage: lightning-mpi -n N")
    assert re.search(message, err), err
    assert not (script.parent / "ran").exists()


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_dry_run_prints_command_and_topology_without_launching(capsys, script):
    code, out, err = run_main(
        capsys, ["-n", "3", "--hosts", "localhost", "--env", "A=1 2", "--dry-run", script, "-n", "5", "--flag"]
    )
    assert code == 0
    assert shlex.split(out) == [
        str(VENV_MPIEXEC), "-n", "3", "-hosts", "localhost", "-genv", "A", "1 2",
        sys.executable, str(script), "-n", "5", "--flag",
    ]
    assert "lightning-mpi: localhost: 3 ranks (0-2)" in err
    assert "via MPICH (hydra)" in err
    assert not (script.parent / "ran").exists()


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_hostfile_pass_through_and_translation(capsys, tmp_path, script):
    mpich_file = tmp_path / "hosts.mpich"
    mpich_file.write_text("localhost:2\n127.0.0.1:1\n")
    code, out, err = run_main(capsys, ["-n", "3", "--hostfile", mpich_file, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[3:5] == ["-f", str(mpich_file)]
    assert "localhost: 2 ranks (0-1)" in err and "127.0.0.1: 1 rank (2)" in err

    # Open MPI syntax given to hydra: handed over as a host list that hydra understands.
    ompi_file = tmp_path / "hosts.ompi"
    ompi_file.write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    code, out, err = run_main(capsys, ["-n", "3", "--hostfile", ompi_file, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[3:5] == ["-hosts", "localhost:2,127.0.0.1:1"]
    assert "passed as a host list" in err


@pytest.mark.timeout(30)
def test_slurm_allocation_uses_srun(capsys, monkeypatch, tmp_path, script):
    srun = fake_launcher(tmp_path, "srun", "slurm 23.02.7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    code, out, err = run_main(capsys, ["-n", "4", "--ppn", "2", "--env", "A=1", "--dry-run", script])
    assert code == 0
    assert shlex.split(out) == [
        str(srun), "--ntasks=4", "--ntasks-per-node=2", "--export=ALL,A=1", "--kill-on-bad-exit=1",
        sys.executable, str(script),
    ]
    assert "via Slurm srun" in err and "Slurm places them on node[1-2], at most 2 per node" in err

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n127.0.0.1:2\n")
    code, out, err = run_main(capsys, ["-n", "4", "--hostfile", hostfile, "--ppn", "2", "--dry-run", script])
    assert code == 0
    assert "--nodelist=localhost,127.0.0.1" in shlex.split(out)
    assert "localhost: 2 ranks (0-1)" in err and "127.0.0.1: 2 ranks (2-3)" in err


@needs_venv_mpiexec
@pytest.mark.timeout(30)
def test_explicit_mpiexec_wins_over_slurm(capsys, monkeypatch, tmp_path, script):
    fake_launcher(tmp_path, "srun", "slurm 23.02.7")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    code, out, _ = run_main(capsys, ["-n", "2", "--mpiexec", VENV_MPIEXEC, "--dry-run", script])
    assert code == 0
    assert shlex.split(out)[:3] == [str(VENV_MPIEXEC), "-n", "2"]


@pytest.mark.timeout(30)
def test_help_exits_zero(capsys):
    code, out, _ = run_main(capsys, ["--help"])
    assert code == 0
    assert out.startswith("usage: lightning-mpi -n N [--hosts a,b | --hostfile F]")


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)  # pays `import lightning_mpi` (torch + Lightning) on busy cores
def test_console_script_runs_two_ranks(tmp_path):
    console = Path(sys.executable).parent / "lightning-mpi"
    if not console.exists():
        pytest.skip("console script not installed next to sys.executable")
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    proc = launch([console, "-n", "2", "--env", "LM_TEST_VAR=hello", script, "a b", "--c"], tmp_path)
    code, out, err = finish(proc, 200)
    assert code == 0, err
    for r in range(2):
        assert f"rank {r} of 2 args=['a b', '--c'] env=hello" in out
    assert "lightning-mpi: localhost: 2 ranks (0-1)" in err


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(240)  # pays `import lightning_mpi` (torch + Lightning) on busy cores
def test_python_m_runs_three_ranks(tmp_path):
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    code, out, err = finish(launch([sys.executable, "-m", "lightning_mpi", "-n", "3", script], tmp_path), 200)
    assert code == 0, err
    assert sorted(re.findall(r"rank \d+ of \d+", out)) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]
    assert "localhost: 3 ranks (0-2)" in err


@pytest.mark.timeout(30)
def test_launcher_package_imports_nothing_heavy():
    # Loaded on its own (the lightning_mpi __init__ imports torch): the launcher must start fast
    # and must not load MPI itself.
    heavy = ("torch", "pytorch_lightning", "lightning", "mpi4py", "numpy", "lightning_mpi")
    modules = ("errors", "hosts", "command", "topology", "checks", "process", "cli")
    statement = (
        "assert package.main is cli.main\n"
        f"for name in {modules!r}: importlib.import_module('standalone_launcher.' + name)\n"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    out = subprocess.run(standalone(statement), capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(30)
def test_console_script_entry_point_is_cli_main():
    # The console script and ``python -m lightning_mpi`` both name lightning_mpi.launcher.main.
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["lightning-mpi"]
    module, _, attribute = target.partition(":")
    assert getattr(importlib.import_module(module), attribute) is cli.main
    assert "from lightning_mpi.launcher import main" in (REPO / "lightning_mpi" / "__main__.py").read_text()
