"""Helpers shared by the launcher tests: fake launchers, ``main`` with captured output, and
subprocesses that run the launcher package without importing ``lightning_mpi`` (torch).
"""
from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_mpi.launcher import cli
from tests.mpi_utils import kill_tree, mpi_env

VENV_MPIEXEC = Path(sys.executable).parent / "mpiexec"
needs_venv_mpiexec = pytest.mark.skipif(
    not VENV_MPIEXEC.exists(), reason="needs the mpich wheel's mpiexec next to sys.executable"
)


def fake_launcher(directory: Path, name: str, version_text: str) -> Path:
    """An executable that answers ``--version`` like some MPI launcher, and fails otherwise."""
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then printf "%s\\n" {shlex.quote(version_text)}; exit 0; fi\n'
        "echo 'fake launcher must not run a job' >&2; exit 99\n"
    )
    path.chmod(0o755)
    return path


def run_main(capsys, argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


RANK_SCRIPT = r"""
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
# One write per line: print() writes text and newline separately, and hydra may interleave them.
sys.stdout.write(f"rank {comm.Get_rank()} of {comm.Get_size()} args={sys.argv[1:]} env={os.environ.get('LM_TEST_VAR')}\n")
sys.stdout.flush()
if comm.Get_rank() == 1 and "--fail" in sys.argv:
    sys.exit(3)
"""


def write(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


# The launcher package loaded as a top-level package of its own, without lightning_mpi: the
# lightning_mpi package's __init__ imports torch and Lightning (seconds per process on 2 busy
# cores), which the exit-code and signal tests do not need. The console script and
# ``python -m lightning_mpi`` tests do go through the package.
LAUNCHER_DIR = Path(cli.__file__).parent
STANDALONE = (
    "import importlib, importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location(\n"
    f"    'standalone_launcher', {str(LAUNCHER_DIR / '__init__.py')!r},\n"
    f"    submodule_search_locations=[{str(LAUNCHER_DIR)!r}],\n"
    ")\n"
    "package = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = package  # relative imports and dataclasses look it up here\n"
    "spec.loader.exec_module(package)\n"
    "cli = importlib.import_module('standalone_launcher.cli')\n"
    "process = importlib.import_module('standalone_launcher.process')\n"
)


MAIN = "sys.exit(cli.main(sys.argv[1:]))"


def standalone(statement: str, *argv) -> list[str]:
    """argv running ``statement`` on ``argv``, with the launcher package loaded standalone as
    ``package`` and its modules as ``cli`` and ``process``."""
    return [sys.executable, "-c", STANDALONE + statement, *argv]


def launch(args: list, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [str(a) for a in args],
        cwd=cwd,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a failed test can kill the launcher's group
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:  # a surviving grandchild may hold the pipes open: don't wait for it forever
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        raise AssertionError(f"launcher did not finish in {timeout}s\n{out}\n{err}")
    return proc.returncode, out, err


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for_pid_files(directory: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    files = [directory / f"pid.{r}" for r in range(n)]
    while not all(f.exists() for f in files):
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise AssertionError("ranks did not start")
        time.sleep(0.05)
    return [int(f.read_text()) for f in files]
