"""Tests of :mod:`lightning_mpi.launcher.process`: real launches with the venv's MPICH (exit codes
propagate, SIGINT/SIGTERM stop every rank, ranks that ignore signals are killed after the grace
period) and the escalation on a process tree without MPI.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from lightning_mpi.launcher.process import run_command
from tests.launcher.helpers import (
    MAIN,
    RANK_SCRIPT,
    VENV_MPIEXEC,
    alive,
    finish,
    launch,
    needs_venv_mpiexec,
    standalone,
    wait_for_pid_files,
    write,
)

SLEEP_SCRIPT = """
import os, signal, sys, time
if "--ignore-signals" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
path = os.path.join(sys.argv[1], f"pid.{rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
time.sleep(120)
"""


@pytest.fixture
def rank_pids():
    """Pids the test saw; any still alive at teardown are killed so a failure leaks nothing."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
def test_exit_code_of_a_failing_rank_propagates(tmp_path):
    script = write(tmp_path, "ranks.py", RANK_SCRIPT)
    code, out, err = finish(launch(standalone(MAIN, "-n", "2", script, "--fail"), tmp_path), 60)
    assert code != 0
    assert code == 3, err  # hydra returns the failing rank's code
    assert "rank 1 of 2" in out


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_rank(tmp_path, rank_pids, signum):
    script = write(tmp_path, "sleep.py", SLEEP_SCRIPT)
    proc = launch(standalone(MAIN, "-n", "2", script, tmp_path), tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signum)
    code, _, err = finish(proc, 30)
    assert code == 128 + signum, err
    # The launcher returns once mpiexec is gone; give the ranks' exit a moment under load.
    while any(alive(p) for p in rank_pids) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not any(alive(p) for p in rank_pids)


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
def test_ranks_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path, rank_pids):
    # hydra forwards SIGTERM and waits; the ranks ignore it and live in sessions of their own,
    # so only the launcher's escalation (descendants tracked via /proc) can stop them.
    script = write(tmp_path, "sleep.py", SLEEP_SCRIPT)
    run = "sys.exit(process.run_command(sys.argv[1:], grace_s=1.0))"
    cmd = standalone(run, VENV_MPIEXEC, "-n", "2", sys.executable, script, tmp_path, "--ignore-signals")
    proc = launch(cmd, tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    elapsed = time.monotonic() - t0
    assert code == 128 + signal.SIGTERM, err
    assert 0.9 <= elapsed < 10
    assert not any(alive(p) for p in rank_pids)


TREE_SCRIPT = r"""
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
directory, role = sys.argv[1], sys.argv[2]
if role == "parent":
    # Like hydra's proxy: the child gets a session of its own, out of reach of killpg.
    subprocess.Popen([sys.executable, __file__, directory, "child"], start_new_session=True)
rank = 0 if role == "parent" else 1
with open(os.path.join(directory, f"pid.{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(directory, f"pid.{rank}.tmp"), os.path.join(directory, f"pid.{rank}"))
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_escalation_kills_descendants_in_other_sessions(tmp_path, rank_pids):
    # Without MPI, so nothing but the launcher's own escalation can stop the child: it ignores
    # SIGTERM, lives in another session, and survives its parent's death.
    script = write(tmp_path, "tree.py", TREE_SCRIPT)
    run = "sys.exit(process.run_command(sys.argv[1:], grace_s=1.0))"
    proc = launch(standalone(run, sys.executable, script, tmp_path, "parent"), tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 30)
    assert code == 128 + signal.SIGTERM, err
    deadline = time.monotonic() + 5
    while any(alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in rank_pids)


@pytest.mark.timeout(30)
def test_run_command_exit_codes():
    assert run_command([sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert run_command([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]) == 128 + 9


NOTICE_SCRIPT = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
path = os.path.join(sys.argv[1], f"pid.{rank}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
sys.stdout.write(f"rank {rank} got {got}\\n")
"""


@pytest.mark.mpi
@needs_venv_mpiexec
@pytest.mark.timeout(90)
def test_sigusr1_reaches_every_rank_and_stops_nothing(tmp_path, rank_pids):
    # A preemption notice: the ranks decide what to do with it (checkpoint, stop); the launcher
    # neither stops the job nor counts it as asked to stop, and reports the job's own exit code.
    script = write(tmp_path, "notice.py", NOTICE_SCRIPT)
    proc = launch(standalone(MAIN, "-n", "2", script, tmp_path), tmp_path)
    rank_pids += wait_for_pid_files(tmp_path, 2, proc)
    proc.send_signal(signal.SIGUSR1)
    code, out, err = finish(proc, 60)
    assert code == 0, err
    assert sorted(out.split("\n")[:2]) == [f"rank {r} got [{int(signal.SIGUSR1)}]" for r in range(2)]
    assert "ended after a preemption notice" in err
