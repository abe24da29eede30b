"""A rank whose process stops running while the rest of the run runs is killed, so that the run
heals it as it heals a killed rank: within :attr:`Watchdog.timeout` seconds, not Open MPI's
detector timeout.

A live rank's process always runs a little: its heartbeat thread (:mod:`.liveness`) wakes up every
50 ms, and a main thread that holds Python's interpreter lock meanwhile is computing. A process
none of whose threads ran for seconds is stopped (``SIGSTOP``, a debugger's stop excepted) or frozen
by its kernel (a machine swapping, a cgroup frozen). Measured here: 12 and 30 such processes on 2
cores (load 35), each importing torch and Lightning and then computing, with a 50 ms sleeper
thread: the longest time any of them went without running was 0.11 s.

The beating process beside each rank (:mod:`.quorum`'s, which runs in a session of its own and
needs no lock of its rank's) reads its rank's CPU time, every thread's, from ``/proc`` a few times a
second, and each beat it sends to its peers says how long ago its rank last ran. It kills its rank
(``SIGKILL``) when the rank has not run for :attr:`Watchdog.timeout` seconds and a peer's rank ran
well after this rank stopped (half the timeout later). Open MPI's runtime sees the process end at
once, and the survivors heal: a hang then costs about the timeout, where Open MPI's heartbeat
detector needs ``--hang-timeout`` (8 s), which must cover a live rank's start-up stalls of its
interpreter lock (measured: 5.4-7.7 s with 10 ranks on 2 cores).

What it leaves alone:

- a whole job stopped at once (a ``Ctrl-Z`` that the launcher passes on to every rank, a Slurm
  suspend): no peer ran after this rank stopped, so nobody is killed, and the job goes on when it is
  continued;
- a process stopped under a debugger (``ptrace``: state ``t``);
- a beating process that was not scheduled for half the timeout judges nothing from that gap;
- a rank frozen on purpose by its quorum (the side of a partition that stops): the beating process
  that froze it stops watching;
- a rank whose thread hangs while its process runs (a kernel that never returns): it runs, so
  ``collective_timeout`` is what ends that wait; a whole host that freezes or drops off the network:
  its beating processes freeze or go silent with it, and Open MPI's detector finds it.

Linux only (``/proc``); no MPI, no torch.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

__all__ = ["Watchdog", "cpu_time", "process_state"]


def cpu_time(pid: int) -> int:
    """Nanoseconds that the threads of process ``pid`` now alive have run on a CPU, from
    ``/proc/PID/task/*/schedstat``; raises ``OSError`` once the process is gone. A thread that ends
    takes its share with it, so the sum may also go down: what counts is that it changed."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return total


def process_state(pid: int) -> str:
    """A process's state letter (``T``: stopped, ``t``: stopped by a debugger), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


class Watchdog:
    """Whether process ``pid`` stopped running while its peers ran (module docstring).

    Args:
        pid: the rank's process.
        timeout: seconds it may go without running at all while a peer runs.
        now: the time of the first look (``time.monotonic()``).
    """

    def __init__(self, pid: int, timeout: float, now: float) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0")
        self.pid = pid
        self.timeout = float(timeout)
        self.last_ran = now  # when the process was last seen to have run
        self._cpu: int | None = None

    def look(self, now: float) -> None:
        """Read the process's CPU time; if it changed since the last look, it ran."""
        try:
            cpu = cpu_time(self.pid)
        except OSError:  # gone: nothing more to judge (the beating process ends with it)
            return
        if cpu != self._cpu:
            self._cpu = cpu
            self.last_ran = now

    def excuse(self, now: float) -> None:
        """The caller did not run for a while: count the process as having run ``now``."""
        self.last_ran = max(self.last_ran, now)

    def verdict(self, now: float, peers_ran: Iterable[float], who: str) -> str | None:
        """Why the process must be killed now, or ``None``. ``peers_ran``: when each peer's rank
        last ran (on this process's clock); ``who``: the process, for the message."""
        still = now - self.last_ran
        if still < self.timeout:
            return None
        if not any(ran >= self.last_ran + self.timeout / 2 for ran in peers_ran):
            return None  # no peer ran since: the whole run stopped (or none is heard)
        try:
            if process_state(self.pid) == "t":  # a debugger holds it
                return None
        except OSError:
            return None
        return (
            f"lightning_mpi: {who} ({socket.gethostname()}, pid {self.pid}) has not run for {still:.1f} s "
            "while the rest of the run ran (stopped by a signal, or frozen by its kernel): killed, so that the "
            f"run heals it as a lost rank (`lightning-mpi --freeze-timeout`, {self.timeout:g} s here; 0 turns "
            "this off)"
        )
