"""Relaunching a failed job (``--max-restarts``), on fewer ranks if hosts were lost (``--min-ranks``).

torchrun's ``--max-restarts``, for MPI: one MPI job cannot lose a rank and go on (``MPI_COMM_WORLD``
is fixed), so a failure ends the whole job -- a rank raised, was killed, or its host vanished, and
``mpiexec`` exits non-zero -- and the launcher starts it again, up to N times. Each relaunch exports
:data:`RESTART_ENV` ``= k`` (attempt k of N) to every rank; the strategies then resume every
``fit(ckpt_path=None)`` from the newest checkpoint all ranks can read
(:mod:`lightning_mpi.strategies.resume`).

Not restarted: a job that exited 0 (finished, or stopped cleanly after a preemption notice), and a
job this launcher was asked to stop (SIGINT/SIGTERM).

Before a relaunch the hosts are checked again: the hostfile is re-read (a scheduler or an operator
may have removed a dead node from it) and every host must still resolve. The ranks hydra had placed
on a lost host are dropped; the job goes on with the rest when at least ``min_ranks`` remain.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import LaunchError
from .hosts import HostEntry, parse_hostfile
from .topology import plan_topology

__all__ = [
    "RESTART_ENV",
    "RESUME_ENV",
    "RestartPolicy",
    "describe_exit",
    "lost_hosts",
    "ranks_left",
    "should_restart",
]

#: Exported to every rank of a relaunch: the attempt number k >= 1 (the first launch has none).
RESTART_ENV = "LIGHTNING_MPI_RESTART"
#: Exported by ``lightning-mpi --resume``: resume from the newest common checkpoint on the first
#: launch too (after a preemption, or to continue a finished run with a larger ``max_epochs``).
RESUME_ENV = "LIGHTNING_MPI_RESUME"


@dataclass(frozen=True)
class RestartPolicy:
    """How often to relaunch a failed job, and on how few ranks it may go on.

    - ``max_restarts``: relaunches after the first launch, >= 0.
    - ``min_ranks``: the fewest ranks a relaunch may run on, 1 <= ``min_ranks`` <= ``nprocs``;
      ``None`` means ``nprocs`` (never shrink).
    """

    max_restarts: int = 0
    min_ranks: int | None = None

    def check(self, nprocs: int) -> None:
        """Raise :class:`LaunchError` naming the option, its value and the fix."""
        if self.max_restarts < 0:
            raise LaunchError(f"argument --max-restarts: {self.max_restarts} is negative; fix: give 0 or more")
        if self.min_ranks is not None and not 1 <= self.min_ranks <= nprocs:
            raise LaunchError(
                f"argument --min-ranks: {self.min_ranks} is not between 1 and -n {nprocs}; "
                f"fix: give at most the number of ranks, e.g. --min-ranks {max(1, nprocs // 2)}"
            )


def describe_exit(code: int) -> str:
    """``"exit code 3"``, or ``"exit code 137 (128 + SIGKILL)"`` when the code reads as a signal."""
    if 128 < code < 128 + signal.NSIG:
        try:
            return f"exit code {code} (128 + {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"


def should_restart(code: int, stopped_by: int | None, attempt: int, policy: RestartPolicy) -> bool:
    """Whether attempt ``attempt`` (0 = the first launch), which ended with ``code``, is relaunched."""
    return code != 0 and stopped_by is None and attempt < policy.max_restarts


def _resolves(name: str) -> str | None:
    """``None`` if ``name`` resolves, else why not."""
    try:
        socket.gethostbyname(name)
    except OSError as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return None


def lost_hosts(entries: Sequence[HostEntry], hostfile: str | None) -> dict[str, str]:
    """Hosts of ``entries`` that a relaunch cannot use, with the reason: gone from ``hostfile``
    (re-read now; an unreadable or empty file loses no host, the launch will say what is wrong) or
    no longer resolving."""
    lost: dict[str, str] = {}
    if hostfile is not None:
        try:
            with open(hostfile) as handle:
                listed = {e.name for e in parse_hostfile(handle.read(), source=hostfile).entries}
        except (OSError, ValueError):
            listed = {e.name for e in entries}
        for entry in entries:
            if entry.name not in listed:
                lost[entry.name] = f"no longer in {hostfile}"
    for entry in entries:
        if entry.name not in lost:
            reason = _resolves(entry.name)
            if reason is not None:
                lost[entry.name] = f"does not resolve ({reason})"
    return lost


def ranks_left(
    nprocs: int, entries: Sequence[HostEntry], ppn: int | None, lost: Sequence[str], by_node: bool = False
) -> int:
    """How many of the ``nprocs`` ranks placed as :func:`plan_topology` says are on hosts not in ``lost``."""
    gone = set(lost)
    return sum(len(ranks) for host, ranks in plan_topology(nprocs, entries, ppn, by_node) if host not in gone)
