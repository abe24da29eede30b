"""A rank whose process is stopped while the rest of the run runs is killed, so that the run heals it
as it heals a killed rank: within :attr:`Watchdog.timeout` seconds, not Open MPI's detector timeout.

A process stopped by a signal (``SIGSTOP``; ``SIGTTIN`` or ``SIGTTOU``, a rank that touched the
terminal from the background) does not run again until it is continued, and nothing in it answers:
Open MPI's heartbeat detector declares it failed after ``--hang-timeout`` (8 s), which must cover a
live rank's start-up stalls of Python's interpreter lock (measured: 5.4-7.7 s with 10 ranks on 2
cores). The beating process beside each rank (:mod:`.quorum`'s, in a session of its own, needing no
lock of its rank's) looks at its rank's state in ``/proc`` a few times a second, and each beat it
sends to its peers says how long ago its rank was last seen not stopped. It kills its rank
(``SIGKILL``) when the rank has been stopped for :attr:`Watchdog.timeout` seconds and a peer's rank
was seen going well after this one stopped (half the timeout later). Open MPI's runtime sees the
process end at once, and the survivors heal.

Stopped, not merely idle: a live rank can go seconds without running at all. Measured at 8 ranks and
2 spares on 2 cores, in a network partition: a rank of the side that went on, and a spare, did not
run for 2.8 s (every thread waiting, the heartbeat thread included; on what, not found), and a
watchdog that judged by CPU time killed both, leaving too few ranks to go on.

What it leaves alone:

- a whole job stopped at once (a ``Ctrl-Z`` that the launcher passes on to every rank, a Slurm
  suspend): no peer was going after this rank stopped, so nobody is killed, and the job goes on
  when it is continued;
- a process stopped under a debugger (``ptrace``: state ``t``, not ``T``);
- a beating process that was not scheduled for half the timeout judges nothing from that gap;
- a rank frozen on purpose by its quorum (the side of a partition that stops): the beating process
  that froze it stops watching;
- a rank that hangs while it is not stopped (a kernel that never returns, a process frozen by its
  kernel): Open MPI's detector finds a process that sends no heartbeat, and ``collective_timeout``
  ends the wait for one that does; a whole host that freezes or drops off the network: its beating
  processes freeze or go silent with it, and Open MPI's detector finds it.

Linux only (``/proc``); no MPI, no torch.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

__all__ = ["Watchdog", "process_state"]


def process_state(pid: int) -> str:
    """A process's state letter (``T``: stopped by a signal, ``t``: stopped by a debugger), from
    ``/proc``; raises ``OSError`` once the process is gone."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class Watchdog:
    """Whether process ``pid`` has been stopped while its peers went on (module docstring).

    Args:
        pid: the rank's process.
        timeout: seconds it may stay stopped while a peer goes on.
        now: the time of the first look (``time.monotonic()``).
    """

    def __init__(self, pid: int, timeout: float, now: float) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
        self.pid = pid
        self.timeout = float(timeout)
        self.last_going = now  # when the process was last seen not stopped

    def look(self, now: float) -> None:
        """Look at the process's state: not stopped, it is going."""
        try:
            stopped = process_state(self.pid) == "T"
        except OSError:  # gone: nothing more to judge (the beating process ends with it)
            return
        if not stopped:
            self.last_going = now

    def excuse(self, now: float) -> None:
        """The caller did not run for a while: count the process as going ``now``."""
        self.last_going = max(self.last_going, now)

    def verdict(self, now: float, peers_going: Iterable[float], who: str) -> str | None:
        """Why the process must be killed now, or ``None``. ``peers_going``: when each peer's rank
        was last seen not stopped (on this process's clock); ``who``: the process, for the message."""
        stopped = now - self.last_going
        if stopped < self.timeout:
            return None
        if not any(going >= self.last_going + self.timeout / 2 for going in peers_going):
            return None  # no peer went on since: the whole run stopped (or none is heard)
        return (
            f"lightning_mpi: {who} ({socket.gethostname()}, pid {self.pid}) has been stopped for {stopped:.1f} s "
            "while the rest of the run went on (a SIGSTOP, or a SIGTTIN from reading the terminal in the "
            f"background): killed, so that the run heals it as a lost rank (`lightning-mpi --freeze-timeout`, "
            f"{self.timeout:g} s here; 0 turns this off)"
        )
