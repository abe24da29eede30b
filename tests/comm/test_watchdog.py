"""comm/watchdog: a rank whose process stops running while its peers run is killed by the beating
process beside it (so that the run heals it as a killed rank); a whole run stopped at once, and a
rank whose peers say nothing of their own, are left alone. The process under test is a child with a
quorum (tests/comm/test_quorum.py's); this test process plays its peers. The heal that follows such
a kill, under mpiexec, is in tests/strategies/test_heal.py."""

import signal
import subprocess
import sys
import time

import pytest

from lightning_mpi.comm.watchdog import Watchdog, cpu_time, process_state
from tests.comm.test_quorum import Peer, start


def beat_ran_for(seconds, child, beacon, peers, stopped_at=None):
    """Beat to ``child`` for ``seconds`` (or until it ends), each peer saying its rank ran just now,
    or, with ``stopped_at``, that it stopped then too."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and child.poll() is None:
        for peer in peers:
            peer.beat_ran(beacon, 0.0 if stopped_at is None else time.monotonic() - stopped_at)
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_rank_stopped_while_its_peers_run_is_killed_and_says_why():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        beat_ran_for(2.5, child, beacon, [a, b])  # it runs (its waking thread): stays
        assert child.poll() is None
        child.send_signal(signal.SIGSTOP)
        beat_ran_for(20.0, child, beacon, [a, b])  # its peers run on
        assert child.wait(timeout=10) == -signal.SIGKILL
        err = child.stderr.read().decode()
        assert "lightning_mpi: rank 2 (" in err and "has not run for " in err
        assert "while the rest of the run ran (stopped by a signal, or frozen by its kernel): killed" in err
        assert "`lightning-mpi --freeze-timeout`, 1 s here" in err
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_a_whole_run_stopped_at_once_and_peers_that_say_nothing_of_their_ranks_kill_nobody():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        beat_ran_for(1.5, child, beacon, [a, b])
        child.send_signal(signal.SIGSTOP)  # the launcher stops every rank at once (a Ctrl-Z)
        beat_ran_for(4.0, child, beacon, [a, b], stopped_at=time.monotonic())
        assert child.poll() is None
        child.send_signal(signal.SIGCONT)
        beat_ran_for(2.0, child, beacon, [a, b])
        assert child.poll() is None  # continued, it runs on
    finally:
        child.kill()
        child.wait()
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2, freeze_timeout=1.0)
    try:
        child.send_signal(signal.SIGSTOP)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:  # plain beats: heard, but nothing said of when their ranks ran
            a.beat(beacon)
            b.beat(beacon)
            time.sleep(0.05)
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
        beat_ran_for(4.0, child, beacon, [a, b])
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_verdict_needs_the_timeout_and_a_peer_that_ran_well_after():
    """The rule itself, on a process that never runs (stopped) and made-up times."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # started
        sleeper.send_signal(signal.SIGSTOP)
        while process_state(sleeper.pid) != "T":
            time.sleep(0.01)
        dog = Watchdog(sleeper.pid, timeout=2.0, now=100.0)
        dog.look(100.0)  # a first look: it ran then
        dog.look(103.0)  # not since
        assert dog.last_ran == 100.0
        assert dog.verdict(101.0, [101.0], "rank 1") is None  # still for less than the timeout
        assert dog.verdict(103.0, [100.5], "rank 1") is None  # no peer ran a half timeout after it stopped
        assert dog.verdict(103.0, [], "rank 1") is None  # no peer heard
        said = dog.verdict(103.0, [100.5, 101.0], "rank 1")
        assert said is not None and "rank 1 (" in said and f"pid {sleeper.pid}) has not run for 3.0 s" in said
        dog.excuse(103.0)  # the caller was not scheduled: the gap counts for nothing
        assert dog.verdict(104.0, [104.0], "rank 1") is None
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.raises(ValueError, match=r"timeout=0: must be a number of seconds > 0"):
        Watchdog(1, timeout=0, now=0.0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = cpu_time(busy.pid)
        time.sleep(0.2)
        assert cpu_time(busy.pid) != first  # it ran
    finally:
        busy.kill()
        busy.wait()
    with pytest.raises(OSError):
        cpu_time(busy.pid)  # gone
