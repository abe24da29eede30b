"""comm/liveness.py: the heartbeat detector's timeout as the ranks see it, and the survivors' kill of
lost ranks on their own host (multi-rank: tests/strategies/test_heal.py, the ``hang`` launch), and MPI
finalized at exit as soon as the heartbeat ends."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_mpi.comm.liveness import (
    DETECTOR_ENV,
    DETECTOR_TIMEOUT_ENV,
    FREEZE_TIMEOUT_ENV,
    Processes,
    detector_timeout,
    freeze_timeout,
)


def test_the_launcher_and_the_ranks_agree_on_the_freeze_timeout_and_the_spares():
    """The launcher imports nothing of ``lightning_mpi.comm``, so the names and the default it
    passes to the ranks are written twice: they must agree."""
    from lightning_mpi.comm import liveness, spares
    from lightning_mpi.launcher import command, healing

    assert (command.FREEZE_TIMEOUT_ENV, command.FREEZE_TIMEOUT) == (FREEZE_TIMEOUT_ENV, liveness.FREEZE_TIMEOUT)
    assert healing.SPARES_ENV == spares.SPARES_ENV


def test_the_freeze_timeout_defaults_to_1_s_and_0_turns_it_off():
    assert freeze_timeout({}) == 1.0  # a plain mpirun --with-ft ulfm with the detector: the default
    assert freeze_timeout({FREEZE_TIMEOUT_ENV: "3.5"}) == 3.5
    assert freeze_timeout({FREEZE_TIMEOUT_ENV: "0"}) is None
    with pytest.raises(ValueError, match=r"LIGHTNING_MPI_FREEZE_TIMEOUT='soon': must be a number of seconds"):
        freeze_timeout({FREEZE_TIMEOUT_ENV: "soon"})


def test_the_detector_timeout_is_read_only_when_the_detector_is_on():
    assert detector_timeout({}) is None
    assert detector_timeout({DETECTOR_ENV: "false", DETECTOR_TIMEOUT_ENV: "5"}) is None
    assert detector_timeout({DETECTOR_ENV: "true", DETECTOR_TIMEOUT_ENV: "5"}) == 5.0
    assert detector_timeout({DETECTOR_ENV: "1"}) == 10.0  # Open MPI's own default timeout
    assert detector_timeout({DETECTOR_ENV: "true", DETECTOR_TIMEOUT_ENV: "soon"}) is None


@pytest.mark.timeout(30)
def test_lost_ranks_on_this_host_are_killed_and_the_table_follows_the_survivors():
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)  # a frozen rank
        host, me = Processes.here()
        table = Processes(((host, me), ("another-host", stopped.pid), (host, stopped.pid)), (None, None, None))
        assert table.kill_lost([1]) == []  # on another host: not this survivor's to kill
        assert table.kill_lost([0]) == []  # never itself
        assert table.kill_lost([2]) == [stopped.pid]
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert table.kill_lost([2]) == []  # gone already: nothing to kill
        assert table.survivors([2, 0]).where == ((host, stopped.pid), (host, me))
    finally:
        if stopped.poll() is None:
            stopped.kill()


@pytest.mark.timeout(60)
def test_the_heartbeat_ends_and_mpi_is_finalized_at_exit_before_the_interpreter_tears_down():
    """Open MPI's ULFM ``MPI_Finalize`` waits for every rank, and a rank that answers no heartbeat
    while its interpreter tears down (mpi4py finalizes only after that) was declared failed: the
    heartbeat's exit handler finalizes MPI at once. An exit handler registered before it runs after
    it, and sees MPI finalized; the process ends cleanly."""
    script = textwrap.dedent(
        """
        import atexit
        from mpi4py import MPI
        from lightning_mpi.comm.liveness import Heartbeat

        atexit.register(lambda: print("finalized at exit:", MPI.Is_finalized(), flush=True))
        beat = Heartbeat()
        print("beating:", beat._thread.is_alive(), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["beating: True", "finalized at exit: True"], done.stdout
