"""Run a Python snippet or script under ``mpiexec -n N`` from pytest, with a hard timeout.

Multi-rank behaviour is tested for real: each test writes a small script, launches it on N
ranks and compares what the ranks print or save against single-process math. The timeout makes
a hang fail fast instead of eating CI.

The MPI is this environment's (the ``mpiexec`` next to ``sys.executable``, then PATH): MPICH
or Open MPI. The command comes from the launcher's own builder, so it carries what Open MPI
needs on a small shared machine (``--oversubscribe``, ``--bind-to none``, ``--allow-run-as-root``
as root), and ``ft=True`` launches with ULFM (Open MPI only: :func:`require_ulfm`).
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import textwrap
from pathlib import Path

from lightning_mpi.launcher.process import descendants

REPO = Path(__file__).resolve().parents[1]


def mpiexec_path() -> str:
    """The venv's mpiexec (from the ``mpich`` wheel) first, then PATH: the launcher's own lookup."""
    from lightning_mpi.launcher.checks import find_mpiexec

    return find_mpiexec()


@functools.cache
def mpi_flavor() -> str:
    """``"mpich"`` or ``"openmpi"`` (or ``"unknown"``): the MPI of :func:`mpiexec_path`."""
    from lightning_mpi.launcher.checks import flavor_from_version, mpiexec_version

    return flavor_from_version(mpiexec_version(mpiexec_path())) or "unknown"


def require_ulfm() -> None:
    """Skip the calling test unless this environment's MPI can heal (Open MPI with ULFM)."""
    import pytest

    if mpi_flavor() != "openmpi":
        pytest.skip(f"needs Open MPI with ULFM (this environment's MPI is {mpi_flavor()}); "
                    "run it in the Open MPI environment: LIGHTNING_MPI_TEST_MPI=openmpi, see .ci/run")


def mpiexec_command(n: int, args: list[str], ft: bool = False) -> list[str]:
    """``mpiexec -n n [flags] python args...`` for this environment's MPI (module docstring)."""
    from lightning_mpi.launcher.command import LaunchSpec, build_command

    spec = LaunchSpec(
        nprocs=n, script=args[0], script_args=tuple(args[1:]), launcher=mpiexec_path(),
        oversubscribe=True, as_root=hasattr(os, "geteuid") and os.geteuid() == 0, heal=ft,
    )
    flavor = mpi_flavor()
    return build_command(spec, flavor if flavor in ("mpich", "openmpi") else "mpich")


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # A test that called seed_everything() leaves PL_GLOBAL_SEED in os.environ; ranks must not
    # inherit it, or their samplers shuffle differently from what the next test expects.
    for leaked in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        env.pop(leaked, None)
    # Oversubscribed ranks on 2 cores: one thread each keeps torch from fighting itself.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    if extra:
        env.update(extra)
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it. MPI ranks, and the processes
    beside them, run in sessions of their own, out of reach of ``killpg``: left running after a
    launch that timed out, they took the CPU from the tests after it (a rank spinning for minutes).
    The tree is read before anything is killed (an orphan is re-parented to init)."""
    below = descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for child, _ in below:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


def run_mpi(
    n: int,
    args: list[str],
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
    ft: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python args...`` (``ft``: with ULFM); kill the whole process tree on timeout."""
    cmd = mpiexec_command(n, args, ft=ft)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=mpi_env(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"mpiexec -n {n} {' '.join(args)} timed out after {timeout}s\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
        )
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"mpiexec -n {n} exited {proc.returncode}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-6000:]}"
        )
    return result


def run_mpi_code(n: int, code: str, tmp_path: Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Write ``code`` (dedented) to a script in tmp_path and run it on n ranks."""
    script = Path(tmp_path) / f"mpi_script_{abs(hash(code)) % 10**8}.py"
    script.write_text(textwrap.dedent(code))
    return run_mpi(n, [str(script)], timeout=timeout, cwd=tmp_path, **kwargs)
