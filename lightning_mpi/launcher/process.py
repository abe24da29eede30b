"""Running the launch command: in a session of its own, with SIGINT/SIGTERM forwarded once and
every process of the job, ranks included, killed after a grace period; SIGUSR1 (a scheduler's
"you will be preempted" notice) is forwarded without stopping anything.

:func:`run_job` runs the job once and says how it ended (:class:`JobOutcome`); :func:`run_command`
returns just the exit code. Whether to run it again is the caller's decision (:mod:`.restarts`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["KILL_GRACE_S", "FORWARDED_ONLY", "JobOutcome", "descendants", "run_command", "run_job"]

#: Seconds between forwarding SIGINT/SIGTERM and killing every remaining process with SIGKILL.
KILL_GRACE_S = 5.0

#: Signals passed on to the job as they are, with no escalation: SIGUSR1 is what Slurm sends
#: (``--signal=USR1@T``) ahead of a preemption, so that the ranks checkpoint and stop by themselves.
#: hydra's mpiexec passes SIGUSR1 and SIGTERM on to every rank (measured with MPICH 5).
FORWARDED_ONLY = (signal.SIGUSR1,)


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (guards against killing a recycled pid), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the last ')' are fixed.
    return stat.rsplit(")", 1)[1].split()[19]


def descendants(root: int) -> list[tuple[int, str]]:
    """``(pid, start_time)`` of every live descendant of ``root``; empty without /proc."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(rest[1]), []).append(int(entry))
        starts[int(entry)] = rest[19]
    found: list[tuple[int, str]] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append((child, starts[child]))
            stack.append(child)
    return found


class _Stopper:
    """Forwards the first SIGINT/SIGTERM to the job and kills what is left after a grace period.

    hydra puts each proxy and each rank into a session of its own (measured with MPICH 5), so
    signalling the launcher's process group does not reach the ranks; mpiexec stops them itself
    on SIGINT/SIGTERM, unless a rank ignores the signal.
    If it does not finish within ``grace_s`` (or a second signal arrives), every process of the
    group and every descendant seen so far is sent SIGKILL, so no rank outlives the job.
    """

    def __init__(self, proc: subprocess.Popen, grace_s: float, sigint_as: int) -> None:
        self.proc = proc
        self.grace_s = grace_s
        self.sigint_as = sigint_as
        self.signum: int | None = None
        self.notices: list[int] = []
        self._tracked: dict[int, str] = {}
        self._timer: threading.Timer | None = None
        # Re-entrant: a third Ctrl-C can interrupt the main thread inside kill().
        self._lock = threading.RLock()

    def _track(self) -> None:
        # Snapshot now: once the launcher dies its ranks are re-parented and can't be found.
        self._tracked.update(descendants(self.proc.pid))

    def on_notice(self, signum: int, frame: object) -> None:
        """Pass a notice (SIGUSR1) on to the job; the job decides what to do with it."""
        self.notices.append(signum)
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def on_signal(self, signum: int, frame: object) -> None:
        with self._lock:
            self._track()
        if self.signum is not None:
            self.kill()  # a second Ctrl-C means "now"
            return
        self.signum = signum
        forward = self.sigint_as if signum == signal.SIGINT else signum
        try:
            os.killpg(self.proc.pid, forward)
        except ProcessLookupError:
            pass
        self._timer = threading.Timer(self.grace_s, self.kill)
        self._timer.daemon = True
        self._timer.start()

    def kill(self) -> None:
        with self._lock:
            self._track()
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for pid, start in self._tracked.items():
                if _start_time(pid) == start:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    def finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.signum is not None:
            # The job was asked to stop: sweep anything the launcher left behind.
            self.kill()


@dataclass(frozen=True)
class JobOutcome:
    """How one run of the job ended.

    - ``code``: the exit code as :func:`run_command` reports it (128 + S when stopped by signal S).
    - ``returncode``: the launcher process's own exit status (negative -S if a signal killed it).
    - ``stopped_by``: the SIGINT/SIGTERM this process received and forwarded, or ``None``: a job
      that was asked to stop is never restarted.
    - ``notices``: the SIGUSR1 notices passed on to the job while it ran.
    - ``ended_after_finish``: the job was killed because it did not end within the grace period
      after ``finished()`` became true (see :func:`run_job`).
    """

    code: int
    returncode: int
    stopped_by: int | None = None
    notices: tuple[int, ...] = ()
    ended_after_finish: bool = False


def run_job(
    cmd: Sequence[str],
    *,
    grace_s: float = KILL_GRACE_S,
    sigint_as: int = signal.SIGINT,
    env: Mapping[str, str] | None = None,
    finished: Callable[[], bool] | None = None,
) -> JobOutcome:
    """Run ``cmd`` in a new session and report how it ended (see :func:`run_command`).

    ``finished``, polled twice a second, says that the job's work is done (``--heal``: every
    surviving rank marked it): a job still running ``grace_s`` seconds later is killed, as Open MPI
    can wait forever in ``MPI_Finalize`` after ranks were lost (``ended_after_finish``).
    """
    # A new session keeps a terminal's Ctrl-C from reaching the job directly: we forward it
    # once, in order, and own the escalation.
    proc = subprocess.Popen(list(cmd), start_new_session=True, env=None if env is None else dict(env))
    stopper = _Stopper(proc, grace_s, sigint_as)
    ended_after_finish = threading.Event()
    if finished is not None:
        threading.Thread(
            target=_end_after_finish,
            args=(proc, stopper, finished, grace_s, ended_after_finish),
            name="lightning-mpi finish watcher",
            daemon=True,
        ).start()
    # what signal.signal() returned: a handler, SIG_DFL or SIG_IGN, or None (not set from Python)
    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, stopper.on_signal)
        for signum in FORWARDED_ONLY:
            previous[signum] = signal.signal(signum, stopper.on_notice)
    try:
        returncode = proc.wait()
    finally:
        # Handlers first, so that no new forwarding starts while finish() sweeps.
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        stopper.finish()
    if stopper.signum is not None:
        code = 128 + stopper.signum
    else:
        code = 128 - returncode if returncode < 0 else returncode
    return JobOutcome(code, returncode, stopper.signum, tuple(stopper.notices), ended_after_finish.is_set())


def _end_after_finish(
    proc: subprocess.Popen, stopper: _Stopper, finished: Callable[[], bool], grace_s: float, ended: threading.Event
) -> None:
    """Kill the job if it is still running ``grace_s`` seconds after ``finished()`` became true."""
    while proc.poll() is None and not finished():
        time.sleep(0.5)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            ended.set()
            stopper.kill()
            return
        time.sleep(0.1)


def run_command(
    cmd: Sequence[str],
    *,
    grace_s: float = KILL_GRACE_S,
    sigint_as: int = signal.SIGINT,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``cmd`` in a new session and return its exit code (death by signal S -> 128 + S).

    While it runs (and when called from the main thread), SIGINT and SIGTERM are forwarded to
    the job's process group -- SIGINT as ``sigint_as`` (srun needs SIGTERM: one SIGINT only
    makes it print status) -- and after ``grace_s`` seconds, or on a second signal, every
    remaining process of the job, ranks included, is killed. A job stopped this way returns
    128 + the received signal even if the launcher exited 0. SIGUSR1 is forwarded as it is.
    """
    return run_job(cmd, grace_s=grace_s, sigint_as=sigint_as, env=env).code
