"""comm/quorum: a process that stops hearing most of the run's training ranks is frozen by its
beating process and, continued, killed; nothing else stops it: peers never heard, goodbyes. The
process under test is a child; this test process plays its peers, beating to it over UDP on
localhost. A real partition between simulated hosts is in tests/benchmarks/test_partition.py."""

import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_mpi.comm.quorum import BYE, Beacon, Quorum, local_addresses

CHILD = textwrap.dedent(
    """
    import pickle, sys, time
    from lightning_mpi.comm.quorum import Beacon, Quorum

    quorum = Quorum(timeout=1.0, freeze_timeout=None if sys.argv[1] == "None" else float(sys.argv[1]))
    print(pickle.dumps(quorum.beacon).hex(), flush=True)
    training, spares, min_ranks, me_training = pickle.loads(sys.stdin.buffer.read())
    (training if me_training else spares).append(quorum.beacon)
    quorum.watch(training, spares, min_ranks)
    time.sleep(60)
    """
)


class Peer:
    """A stand-in process of the run: a UDP socket on localhost and a token."""

    def __init__(self):
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("127.0.0.1", 0))
        self.socket.settimeout(0.05)
        self.beacon = Beacon(("127.0.0.1",), self.socket.getsockname()[1], secrets.token_bytes(8))

    def beat(self, to: Beacon, what: bytes = b"") -> None:
        self.socket.sendto(self.beacon.token + what, ("127.0.0.1", to.port))

    def beat_going(self, to: Beacon, ago: float) -> None:
        """A beat that says this peer's rank was last seen not stopped ``ago`` seconds ago (comm.watchdog)."""
        self.beat(to, struct.pack("!d", ago))

    def heard_from(self, who: Beacon) -> bool:
        try:
            while True:
                if self.socket.recv(64)[:8] == who.token:
                    return True
        except TimeoutError:
            return False


def start(training, spares, min_ranks, me_training=True, freeze_timeout=None):
    """A process with a quorum (and a freeze timeout), watching ``training`` and ``spares`` with
    itself among the training ranks (the last) or the spares: (the process, its beacon)."""
    import pickle

    env = dict(os.environ)
    env.pop("LIGHTNING_MPI_HEAL_OUTCOME", None)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, repr(freeze_timeout)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    beacon = pickle.loads(bytes.fromhex(child.stdout.readline().decode()))
    child.stdin.write(pickle.dumps(([p.beacon for p in training], [p.beacon for p in spares], min_ranks, me_training)))
    child.stdin.close()
    return child, beacon


def frozen(child, within: float) -> bool:
    """Whether ``child`` stopped itself (state T) within ``within`` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        with open(f"/proc/{child.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.05)
    return False


def beat_for(seconds, child_beacon, peers):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for peer in peers:
            peer.beat(child_beacon)
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_training_rank_that_stops_hearing_a_majority_freezes_says_why_and_dies_when_continued():
    a, b = Peer(), Peer()
    child, beacon = start([a, b], [], min_ranks=2)
    try:
        beat_for(3.0, beacon, [a, b])  # 3 of 3 heard: stays, and beats to its peers
        assert child.poll() is None
        assert a.heard_from(beacon) and b.heard_from(beacon)
        beat_for(3.0, beacon, [a])  # 2 of 3 (itself and a): still min_ranks
        assert child.poll() is None
        assert frozen(child, within=10)  # nobody: 1 of 3 < 2
        assert child.poll() is None
        child.send_signal(signal.SIGCONT)  # Open MPI's runtime ends it
        assert child.wait(timeout=10) == -signal.SIGKILL
        err = child.stderr.read().decode()
        assert "hears 1 of the run's 3 training ranks (itself included) for 1 s, fewer than min_ranks=2" in err
        assert "(ranks 0, 1 silent for " in err  # a and b, ranks 0 and 1 of the run (it is rank 2)
    finally:
        child.kill()


@pytest.mark.timeout(60)
def test_a_spare_cut_off_from_the_training_ranks_freezes_too():
    a, b, c = Peer(), Peer(), Peer()
    child, beacon = start([a, b, c], [], min_ranks=2, me_training=False)
    try:
        beat_for(2.0, beacon, [a, b, c])
        assert child.poll() is None
        assert frozen(child, within=10)
        child.send_signal(signal.SIGCONT)
        assert child.wait(timeout=10) == -signal.SIGKILL
        err = child.stderr.read().decode()
        assert "hears 0 of the run's 3 training ranks" in err and "(ranks 0, 1, 2 silent for " in err
    finally:
        child.kill()


@pytest.mark.timeout(60)
def test_a_cut_that_no_side_can_go_on_from_freezes_nobody():
    """5 training ranks, min_ranks=4: hearing 2 of 5, the 3 not heard cannot go on either, so the
    process is left to Open MPI and the heal (RunStopped on every side), not frozen; with
    min_ranks=3 the 3 could go on, and it freezes."""
    peers = [Peer() for _ in range(4)]
    child, beacon = start(peers, [], min_ranks=4)
    try:
        beat_for(1.5, beacon, peers)
        beat_for(4.0, beacon, peers[:1])  # 4 timeouts hearing itself and one peer
        assert not frozen(child, within=0.5) and child.poll() is None
        child.kill()
        child.wait(timeout=10)
        err = child.stderr.read().decode()
        assert err.count("hears 2 of the run's 5 training ranks, and the 3 it does not hear are fewer than") == 1
        assert "min_ranks=4 too: no side can go on, so it is not frozen" in err
    finally:
        child.kill()
    peers = [Peer() for _ in range(4)]
    child, beacon = start(peers, [], min_ranks=3)
    try:
        beat_for(1.5, beacon, peers)
        beat_for(1.0, beacon, peers[:1])
        assert frozen(child, within=10)
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_peers_never_heard_and_peers_that_said_goodbye_count_as_heard():
    quiet, leaving, other = Peer(), Peer(), Peer()
    child, beacon = start([quiet, leaving, other], [], min_ranks=4)
    try:
        beat_for(1.0, beacon, [leaving, other])
        leaving.beat(beacon, BYE)  # ended normally
        other.beat(beacon, BYE)
        # 4 timeouts: quiet never beat (UDP blocked?), the others said goodbye
        assert not frozen(child, within=4.0) and child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_quorum_needs_a_positive_timeout_and_knows_its_host():
    with pytest.raises(ValueError, match=r"timeout=0: must be a number of seconds > 0"):
        Quorum(0)
    assert local_addresses() and all(address.count(".") == 3 for address in local_addresses())
