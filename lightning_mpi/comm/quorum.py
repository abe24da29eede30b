"""A process cut off from most of the run stops before it can report the others failed.

Under ``lightning-mpi --heal`` Open MPI's heartbeat detector declares a rank that stops answering
failed (:mod:`.liveness`). When a host's link drops, both sides of the cut declare the other side
failed, and nothing in Open MPI tells a side apart from the other: the side cut off reports the
majority's ranks failed to its own runtime daemon, which cannot pass the reports on while the link
is down, and passes them on when it comes back. A live rank reported failed aborts (Open MPI's
``ompi_proc_mark_as_failed``: "I have been reported dead by someone else"), so a partition shorter
than the run ended the run of the side that had healed and gone on (measured: a 15 s partition of
one of 3 hosts, 2 runs of 5).

So every process of a healing job also sends a small UDP datagram, a *beat*, to every other process
of the run, every ``timeout / 8`` seconds, from a small process of its own (``python -m
lightning_mpi.comm.quorum``, its child): a thread of the training process itself went silent for
seconds at a time whenever an MPI call held Python's interpreter lock, and the ranks that missed its
beats stopped (measured: 8 ranks, all of them stopped one after a heal began). A process that hears
fewer of the run's training ranks (itself included) than ``min_ranks`` for :attr:`Quorum.timeout`
seconds (0.6 of Open MPI's detector timeout: it fires first) is on the side of a cut that must
stop: its beating process writes why (and, for a training rank, leaves the launcher's failure
mark), and freezes it (``SIGSTOP``): no MPI call, no report, no checkpoint from then on. The side with the majority
hears enough, heals when Open MPI's detector declares the other side failed, and goes on; when the
link is back, nothing arrives from the frozen side. A process whose unheard ranks are fewer than
``min_ranks`` too is not frozen: no side can go on, so it is left to Open MPI's detector and the
heal, which stops every side (``RunStopped``) and ends the job, where frozen sides would hold it
until they are killed (measured, 8 ranks, a cut leaving 4 and 2 of 6 with ``min_ranks=5``: frozen,
the job still ran 30 s after it was asked to stop; not frozen, every side stopped and it ended,
exit code 1).

Frozen, not ended: its sockets stay open, so what the other side had sent it while the link was down
is still received when the link is back. A process that had ended answers those retransmissions
with a reset, which fails sends that Open MPI's non-blocking collectives had already given up and
freed, and an error on a freed request aborts the process (measured: "Send error after request
freed", the healed side's rank 0 aborted when a 15 s partition ended). Once the link is back,
Open MPI's runtime may end the frozen process (the other side reported it failed; it continues it
first): continued, it is killed (``SIGKILL``) by its beating process at once, which the runtime
takes as the failure it already knew of (an exit with a status made it end the whole job:
measured). One that nobody ends (a host cut off for good, a process the runtime left alone, one
frozen without a partition: below) is killed four of Open MPI's detector timeouts after it froze,
so that a job never waits on it for good (``--max-restarts`` relaunches a job that failed).

What can look like a cut, and what does not:

- a peer never heard since it was added (UDP blocked between hosts, a process still starting)
  counts as heard: the quorum judges only peers that it heard and then lost, so a cluster whose
  firewall drops these datagrams behaves as without the quorum;
- a beating process that did not run for half the timeout (not scheduled) judges nothing from that
  gap: every peer counts as heard at its end;
- a process that ends normally says so (a last datagram at exit), and counts as heard from then on:
  ranks that end seconds apart do not make the last ones stop;
- a training process that hangs keeps beating (its beating process runs on): the beating process
  kills a rank that is stopped while its peers go on (:mod:`.watchdog`: each beat says how long ago
  the sender's rank was last seen not stopped), and Open MPI's detector finds a whole host that stopped
  (:mod:`.liveness`).

Cost: ``N - 1`` datagrams of 16 bytes per period from each of ``N`` processes (64 ranks at the
default 8 s timeout: 126 datagrams a second each), and a Python process of about 25 MB beside each
rank. Linux only (the host's addresses are read with ``SIOCGIFADDR``); MPI is not used here.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from lightning_mpi.comm.ulfm import mark_failed
from lightning_mpi.comm.watchdog import Watchdog, process_state

__all__ = ["Beacon", "Quorum", "local_addresses"]

#: the share of Open MPI's detector timeout after which a process cut off from a majority stops:
#: Open MPI's detector on that side declares the other side failed ``timeout - period`` to
#: ``timeout`` after the cut (its period is a fifth of the timeout), this one ``share * timeout``
LEAVE_SHARE = 0.6
#: beats per timeout
BEATS = 8
#: a frozen process not ended by then (Open MPI's detector timeouts) is killed: the job does not
#: wait for good on a host cut off for good, nor on a side that stopped without a partition
FROZEN_TIMEOUTS = 4
#: what a process sends when it ends normally (after its token)
BYE = b"bye"
_SIOCGIFADDR = 0x8915


def local_addresses() -> tuple[str, ...]:
    """This host's IPv4 addresses (``127.0.0.1`` alone on a host without a network)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            found.append(socket.inet_ntoa(packed[20:24]))
    outside = [a for a in found if not a.startswith("127.")]
    return tuple(outside) or ("127.0.0.1",)


@dataclass(frozen=True)
class Beacon:
    """Where a process hears beats (its host's addresses and a UDP port), and the token its beats
    carry."""

    addresses: tuple[str, ...]
    port: int
    token: bytes


class Quorum:
    """This process's side of its beats (module docstring): starts its beating process on
    construction, which beats to nobody and judges nothing until :meth:`watch`; :meth:`stop` ends
    it (at exit, saying goodbye).

    Args:
        timeout: seconds hearing fewer than ``min_ranks`` training ranks before this process stops.
        freeze_timeout: seconds this process may stay stopped (``SIGSTOP``) while a peer goes on before
            its beating process kills it (:mod:`.watchdog`); ``None``: never.
    """

    def __init__(self, timeout: float, freeze_timeout: float | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
        if freeze_timeout is not None and not freeze_timeout > 0:
            raise ValueError(f"freeze_timeout={freeze_timeout!r}: must be a number of seconds > 0, or None")
        self.timeout = float(timeout)
        self._child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), repr(self.timeout), repr(freeze_timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # a session of its own: Linux's autogroup scheduler then gives it a share of its own
            # rather than a slice of its busy rank's session (measured, 10 busy processes on 2 cores:
            # woken 40-53 ms late at worst in the rank's session, 4-5 ms in its own)
            start_new_session=True,
        )
        assert self._child.stdout is not None
        self.beacon = Beacon(*_read(self._child.stdout))
        atexit.register(self.stop)

    def watch(self, training: Sequence[Beacon | None], spares: Sequence[Beacon | None], min_ranks: int) -> None:
        """From now on the run is ``training`` (its training ranks, this process among them or among
        ``spares``) and ``spares`` (processes waiting to be let in): beat to all of them, and stop
        when fewer than ``min_ranks`` of ``training`` are heard. ``None`` entries (a process without
        a quorum) are neither beaten to nor judged."""
        self._tell(("watch", _plain(training), _plain(spares), int(min_ranks)))

    def stop(self) -> None:
        """End the beating process, which says goodbye to the peers (safe to call twice)."""
        if self._child.poll() is None:
            self._tell(("stop",))
            try:
                self._child.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self._child.kill()

    def _tell(self, message: tuple[Any, ...]) -> None:
        assert self._child.stdin is not None
        try:
            _write(self._child.stdin, message)
        except (BrokenPipeError, ValueError):  # it ended (the process is stopping)
            pass


def _plain(beacons: Sequence[Beacon | None]) -> tuple[tuple[Any, ...] | None, ...]:
    """``beacons`` as plain tuples: the beating process runs this module as ``__main__``, whose
    ``Beacon`` is another class."""
    return tuple(None if b is None else (b.addresses, b.port, b.token) for b in beacons)


def _write(stream: IO[bytes], obj: Any) -> None:
    stream.write(pickle.dumps(obj).hex().encode() + b"\n")
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    line = stream.readline()
    if not line:
        raise EOFError("the quorum's beating process ended before it answered")
    return pickle.loads(bytes.fromhex(line.decode()))


class _Beats:
    """The beating process's work (``python -m lightning_mpi.comm.quorum PARENT TIMEOUT
    FREEZE_TIMEOUT``): beat, listen, judge, freeze ``parent`` when it is cut off, and kill it when it
    is stopped while its peers go on (:mod:`.watchdog`, unless ``freeze_timeout`` is ``None``)."""

    def __init__(self, parent: int, timeout: float, freeze_timeout: float | None) -> None:
        self.parent = parent
        self.timeout = timeout
        self.period = timeout / BEATS
        self.watchdog = None if freeze_timeout is None else Watchdog(parent, freeze_timeout, time.monotonic())
        # a look at the parent's state at every turn of the loop: several per freeze timeout
        self.turn = self.period / 2 if freeze_timeout is None else min(self.period / 2, freeze_timeout / 8)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind(("0.0.0.0", 0))
        self.socket.setblocking(False)
        self.beacon = Beacon(local_addresses(), self.socket.getsockname()[1], secrets.token_bytes(8))
        self.peers: tuple[Beacon, ...] = ()
        self.training: dict[bytes, int] = {}  # token -> training rank
        self.min_ranks = 0  # 0: judging nothing
        self.heard: dict[bytes, float] = {}
        self.going: dict[bytes, float] = {}  # token -> when that peer's rank was last not stopped, by its beats
        self._hopeless = False  # said that no side of a cut can go on

    def run(self, commands: IO[bytes]) -> None:
        """Until told to stop (or the parent is gone): beat every period, take what arrives, judge."""
        last = time.monotonic()
        next_beat = last
        while os.getppid() == self.parent:
            ready, _, _ = select.select([self.socket.fileno(), commands.fileno()], [], [], self.turn)
            now = time.monotonic()
            if commands.fileno() in ready and not self._obey(_read_or_none(commands)):
                return
            self._receive(now)
            if now - last > self.timeout / 2:  # this process did not run: judge nothing from the gap
                self.heard = {t: max(at, now) for t, at in self.heard.items()}  # a goodbye stays
            if self.watchdog is not None:
                if now - last > self.watchdog.timeout / 2:  # the same for the parent's stop
                    self.watchdog.excuse(now)
                self.watchdog.look(now)
            last = now
            if now >= next_beat:
                self._send(b"" if self.watchdog is None else struct.pack("!d", now - self.watchdog.last_going))
                next_beat = now + self.period
            reason = self._cut_off(now)
            if reason is not None:
                self._freeze_parent(reason)
                return
            reason = self._still(now)
            if reason is not None:
                sys.stderr.write(reason + "\n")
                sys.stderr.flush()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.parent, signal.SIGKILL)
                return

    def _obey(self, message: tuple[Any, ...] | None) -> bool:
        """Take a command from the parent; False when the beating ends."""
        if message is None:  # the parent closed the pipe without a goodbye: it is gone
            return False
        if message[0] == "stop":
            self._send(BYE)
            return False
        _, plain_training, plain_spares, min_ranks = message
        training = [Beacon(*b) for b in plain_training if b is not None]
        spares = [Beacon(*b) for b in plain_spares if b is not None]
        self.peers = tuple(b for b in (*training, *spares) if b.token != self.beacon.token)
        self.training = {b[2]: rank for rank, b in enumerate(plain_training) if b is not None}
        self.min_ranks = min_ranks
        return True

    def _receive(self, now: float) -> None:
        while True:
            try:
                data = self.socket.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            token, said = data[:8], data[8:]
            self.heard[token] = float("inf") if said == BYE else now
            if len(said) == 8:  # how long ago the peer's rank was last seen not stopped
                self.going[token] = now - struct.unpack("!d", said)[0]

    def _send(self, what: bytes) -> None:
        payload = self.beacon.token + what
        for peer in self.peers:
            for address in peer.addresses:
                try:
                    self.socket.sendto(payload, (address, peer.port))
                except OSError:  # unreachable now (a cut link): the beat is lost
                    pass

    def _cut_off(self, now: float) -> str | None:
        """Why the parent must stop now, or ``None``."""
        if not self.min_ranks:
            return None
        me = self.beacon.token
        silent = {
            rank: now - self.heard[t]
            for t, rank in self.training.items()
            if t != me and now - self.heard.get(t, now) >= self.timeout
        }
        heard = len(self.training) - len(silent)
        if heard >= self.min_ranks:
            self._hopeless = False
            return None
        if len(silent) < self.min_ranks:
            # the ranks not heard are too few to go on as well: no side of this cut can, so there is no
            # majority to protect, and a frozen side would only hold the job until it is killed
            if not self._hopeless:
                self._hopeless = True
                sys.stderr.write(
                    f"lightning_mpi: this process ({socket.gethostname()}, pid {self.parent}) hears {heard} of the "
                    f"run's {len(self.training)} training ranks, and the {len(silent)} it does not hear are fewer "
                    f"than min_ranks={self.min_ranks} too: no side can go on, so it is not frozen; the run stops "
                    "once Open MPI declares the others failed\n"
                )
                sys.stderr.flush()
            return None
        detail = ""
        if silent:
            quiet = ", ".join(str(rank) for rank in sorted(silent))
            detail = f" (ranks {quiet} silent for {min(silent.values()):.1f}-{max(silent.values()):.1f} s)"
        return (
            f"lightning_mpi: this process ({socket.gethostname()}, pid {self.parent}) hears {heard} of the run's "
            f"{len(self.training)} training ranks (itself included) for {self.timeout:g} s, fewer than "
            f"min_ranks={self.min_ranks}{detail}: it is on the side of a network partition that stops (or the run "
            "lost too many ranks), and is frozen before it can report the other side failed, then killed once "
            f"continued or {FROZEN_TIMEOUTS} detector timeouts later; the side with min_ranks goes on (`lightning-mpi "
            "--max-restarts` relaunches a run that stopped)"
        )

    def _still(self, now: float) -> str | None:
        """Why the parent must be killed now (:mod:`.watchdog`), or ``None``."""
        if self.watchdog is None or not self.peers:
            return None
        peers = {p.token for p in self.peers}
        rank = self.training.get(self.beacon.token)
        who = "a spare" if rank is None else f"rank {rank}"
        return self.watchdog.verdict(now, (at for t, at in self.going.items() if t in peers), who)

    def _freeze_parent(self, reason: str) -> None:
        """Write ``reason`` (and the launcher's failure mark for a training rank), freeze the parent,
        and kill it the moment it is continued, or after :data:`FROZEN_TIMEOUTS` detector timeouts
        (module docstring: why frozen, why killed)."""
        sys.stderr.write(reason + "\n")
        sys.stderr.flush()
        if self.beacon.token in self.training:
            mark_failed()
        try:
            os.kill(self.parent, signal.SIGSTOP)
            seen = time.monotonic() + 1.0  # stopping takes it a moment (unless it is continued first)
            while process_state(self.parent) != "T" and time.monotonic() < seen:
                time.sleep(0.005)
            until = time.monotonic() + FROZEN_TIMEOUTS * self.timeout / LEAVE_SHARE
            while process_state(self.parent) == "T" and time.monotonic() < until:
                time.sleep(0.01)
            os.kill(self.parent, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):  # it ended meanwhile
            pass


def _read_or_none(stream: IO[bytes]) -> Any:
    try:
        return _read(stream)
    except EOFError:
        return None


def main(argv: Sequence[str]) -> None:
    """``python -m lightning_mpi.comm.quorum PARENT TIMEOUT FREEZE_TIMEOUT``: started by :class:`Quorum`; writes
    its :class:`Beacon` on stdout, then takes commands on stdin."""
    parent, timeout = int(argv[0]), float(argv[1])
    freeze_timeout = None if argv[2] == "None" else float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    beats = _Beats(parent, timeout, freeze_timeout)
    _write(sys.stdout.buffer, _plain([beats.beacon])[0])
    # unbuffered: a line left in a buffer would wait for the next one, unseen by select
    with open(sys.stdin.fileno(), "rb", buffering=0, closefd=False) as commands:
        beats.run(commands)


if __name__ == "__main__":
    main(sys.argv[1:])
