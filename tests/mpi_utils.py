"""Run a Python snippet or script under ``mpiexec -n N`` from pytest, with a hard timeout.

Multi-rank behaviour is tested for real: each test writes a small script, launches it on N
ranks and compares what the ranks print or save against single-process math. The timeout makes
a hang fail fast instead of eating CI.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mpiexec_path() -> str:
    """The venv's mpiexec (from the ``mpich`` wheel) first, then PATH: the launcher's own lookup."""
    from lightning_mpi.launcher.checks import find_mpiexec

    return find_mpiexec()


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


def run_mpi(
    n: int,
    args: list[str],
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python args...``; kill the whole process group on timeout."""
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, *args]
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
        os.killpg(proc.pid, signal.SIGKILL)
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
