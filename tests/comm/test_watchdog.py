"""comm/watchdog: a rank whose process is stopped while its peers go on is killed by the beating
process beside it (so that the run heals it as a killed rank); a whole run stopped at once, a rank
whose peers say nothing of their own, and a rank that waits without being stopped are left alone.
The process under test is a child with a quorum (tests/comm/test_quorum.py's); this test process
plays its peers. The heal that follows such a kill, under mpiexec, is in
tests/strategies/test_heal.py."""

import signal
import subprocess
import sys
import time

import pytest

from lightning_mpi.comm.watchdog import Watchdog, process_state
from tests.comm.test_quorum import Peer, beat_for, start


def beat_going_for(seconds, child, beacon, peers, stopped_at=None):
    """Beat to ``child`` for ``seconds`` (or until it ends), each peer saying its rank goes on, or,
    with ``stopped_at``, that it stopped then too."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and child.poll() is None:
        for peer in peers:
            peer.beat_going(beacon, 0.0 if stopped_at is None else time.monotonic() - stopped_at)
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_rank_stopped_while_its_peers_run_is_killed_and_says_why():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        beat_going_for(2.5, child, beacon, [a, b])  # not stopped (it sleeps, mostly): stays
        assert child.poll() is None
        child.send_signal(signal.SIGSTOP)
        beat_going_for(20.0, child, beacon, [a, b])  # its peers run on
        assert child.wait(timeout=10) == -signal.SIGKILL
        err = child.stderr.read().decode()
        assert "lightning_mpi: rank 2 (" in err and "has been stopped for " in err
        assert "while the rest of the run went on (a SIGSTOP, or a SIGTTIN from reading" in err
        assert "killed, so that the run heals it as a lost rank" in err
        assert "`lightning-mpi --freeze-timeout`, 1 s here" in err
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_a_whole_run_stopped_at_once_and_peers_that_say_nothing_of_their_ranks_kill_nobody():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        beat_going_for(1.0, child, beacon, [a, b])
        child.send_signal(signal.SIGSTOP)  # the launcher stops every rank at once (a Ctrl-Z)
        beat_going_for(3.0, child, beacon, [a, b], stopped_at=time.monotonic())
        assert child.poll() is None
        child.send_signal(signal.SIGCONT)
        beat_going_for(1.0, child, beacon, [a, b])
        assert child.poll() is None  # continued, it runs on
    finally:
        child.kill()
        child.wait()
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        child.send_signal(signal.SIGSTOP)
        beat_for(3.0, beacon, [a, b])  # plain beats: heard, but nothing said of when their ranks ran
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_without_a_freeze_timeout_a_stopped_rank_is_left_to_open_mpi():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2)
    try:
        child.send_signal(signal.SIGSTOP)
        beat_going_for(3.0, child, beacon, [a, b])
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_verdict_needs_a_stop_for_the_timeout_and_a_peer_going_well_after():
    """The rule itself, on made-up times: a process that waits (asleep, every thread) is going; one
    stopped by a signal is not."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # started, and asleep
        dog = Watchdog(sleeper.pid, timeout=2.0, now=100.0)
        dog.look(103.0)  # it waits, it does not run: not stopped, so going
        assert dog.last_going == 103.0
        sleeper.send_signal(signal.SIGSTOP)
        while process_state(sleeper.pid) != "T":
            time.sleep(0.01)
        dog = Watchdog(sleeper.pid, timeout=2.0, now=100.0)
        dog.look(103.0)  # stopped since it was last seen going, at 100
        assert dog.last_going == 100.0
        assert dog.verdict(101.0, [101.0], "rank 1") is None  # stopped for less than the timeout
        assert dog.verdict(103.0, [100.5], "rank 1") is None  # no peer going a half timeout after it stopped
        assert dog.verdict(103.0, [], "rank 1") is None  # no peer heard
        said = dog.verdict(103.0, [100.5, 101.0], "rank 1")
        assert said is not None and "rank 1 (" in said and f"pid {sleeper.pid}) has been stopped for 3.0 s" in said
        dog.excuse(103.0)  # the caller was not scheduled: the gap counts for nothing
        assert dog.verdict(104.0, [104.0], "rank 1") is None
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.raises(ValueError, match=r"timeout=0: must be a number of seconds > 0"):
        Watchdog(1, timeout=0, now=0.0)
    with pytest.raises(OSError):
        process_state(sleeper.pid)  # gone
