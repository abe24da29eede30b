"""The ``lightning-mpi`` command line: its usage line and its argument parser.

:func:`build_parser` checks each value's form as it parses (a count, a number of seconds, a host
list, a ``KEY=VALUE``) and names the fix in argparse's own error format, so that a typo stops
before any check runs or any process starts. Whether the values make sense together (``--spares``
without ``--heal``, ``--min-ranks`` above ``-n``) and against the machine is decided afterwards,
by :func:`.cli.main`'s checks. Everything after the script goes to the script.
"""

from __future__ import annotations

import argparse

from .command import ENV_KEY, FREEZE_TIMEOUT, HANG_TIMEOUT
from .errors import PROG
from .hosts import parse_host, positive_int
from .process import KILL_GRACE_S

__all__ = ["USAGE", "build_parser"]

USAGE = (
    "lightning-mpi -n N [--hosts a,b | --hostfile F] [--ppn K] [--mpiexec PATH] "
    "[--env K=V]... [--oversubscribe] [--heal [--spares K]] [--max-restarts R [--min-ranks M]] [--resume] [--grace S] "
    "[--dry-run] script.py [script args]"
)


def _arg_positive_int(text: str) -> int:
    try:
        return positive_int(text, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1") from None


def _arg_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _arg_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _arg_hosts(text: str) -> tuple[str, ...]:
    try:
        return tuple(str(parse_host(h)) for h in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; example: --hosts node1,node2 or node1:4,node2:4") from None


def _arg_env(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not ENV_KEY.match(key):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE with KEY a variable name; example: --env OMP_NUM_THREADS=4"
        )
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-mpi`` argument parser (everything after the script goes to the script)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=USAGE,
        description=(
            "Launch a Python script on N MPI ranks with mpiexec (MPICH hydra or Open MPI), or srun "
            "inside a Slurm allocation, after checking that the job can start."
        ),
        epilog=(
            "examples:\n"
            "  lightning-mpi -n 4 train.py fit --trainer.strategy=mpi_easgd\n"
            "  lightning-mpi -n 8 --hosts node1,node2 --ppn 4 --env OMP_NUM_THREADS=2 train.py\n"
            "  lightning-mpi -n 8 --hostfile hosts.txt --dry-run train.py\n"
            "  lightning-mpi -n 4 --heal train.py          # Open MPI: survivors heal when a rank dies\n"
            "  lightning-mpi -n 4 --heal --spares 1 train.py   # and a spare waits to replace one at once\n"
            "  lightning-mpi -n 8 --hostfile hosts.txt --max-restarts 3 --min-ranks 4 train.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-n",
        "-np",
        "--np",
        dest="nprocs",
        metavar="N",
        type=_arg_positive_int,
        required=True,
        help="number of ranks (>= 1)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--hosts", metavar="a,b", type=_arg_hosts, help="comma-separated hosts, each 'name' or 'name:slots'"
    )
    where.add_argument(
        "--hostfile", metavar="F", help="hostfile: 'host', 'host:slots' (MPICH) or 'host slots=K' (Open MPI) lines"
    )
    parser.add_argument("--ppn", metavar="K", type=_arg_positive_int, help="ranks per node")
    parser.add_argument(
        "--mpiexec", metavar="PATH", help="launcher to use (default: the venv's mpiexec, then PATH; srun under Slurm)"
    )
    parser.add_argument(
        "--env", metavar="K=V", type=_arg_env, action="append", default=[], help="export K=V to every rank (repeatable)"
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more ranks than slots on a host (hydra always does; passed to Open MPI, "
        "and on one machine with more ranks than CPUs it is passed anyway)",
    )
    parser.add_argument(
        "--heal",
        action="store_true",
        help="launch with ULFM fault tolerance (Open MPI: --with-ft ulfm), so that the "
        "survivors of a lost rank can heal and go on; MPICH cannot",
    )
    parser.add_argument(
        "--hang-timeout",
        metavar="S",
        type=_arg_seconds,
        default=HANG_TIMEOUT,
        help=f"with --heal: a rank that answers no heartbeat for S seconds (a frozen process, a lost host) "
        f"is declared failed and healed like a killed one (Open MPI's detector; default {HANG_TIMEOUT:g}; 0: no "
        "detector). Lower detects sooner; a rank starved of CPU for longer than S is declared failed too. A "
        "process that hears fewer than min_ranks training ranks for 0.6 S (the side of a network partition that "
        "stops) freezes first, so that it cannot report the other side failed. On several hosts the ranks are "
        "numbered round-robin over them, so that a host cut off is found in one timeout",
    )
    parser.add_argument(
        "--freeze-timeout",
        metavar="S",
        type=_arg_seconds,
        default=FREEZE_TIMEOUT,
        help=f"with --heal and the detector: a rank whose process stays stopped for S seconds while the other "
        f"ranks go on (SIGSTOP; SIGTTIN from reading the terminal in the background) is killed by the process "
        f"beside it, and healed at once like a killed one (default {FREEZE_TIMEOUT:g}; 0: never, the detector "
        "finds it after --hang-timeout). A whole job stopped at once is left alone",
    )
    parser.add_argument(
        "--spares",
        metavar="K",
        type=_arg_count,
        default=0,
        help="with --heal: launch K more ranks that wait, idle, and take the place of lost ones at "
        "once (heal='replace'; no process to start then); -n counts the training ranks only (default 0)",
    )
    parser.add_argument(
        "--max-restarts",
        metavar="R",
        type=_arg_count,
        default=0,
        help="relaunch a failed job up to R times; the ranks resume from the newest "
        "checkpoint every rank can read (default 0)",
    )
    parser.add_argument(
        "--min-ranks",
        metavar="M",
        type=_arg_positive_int,
        help="a relaunch may go on with M or more ranks when hosts were lost (default: -n, never fewer)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest common checkpoint on the first launch too (after a preemption)",
    )
    parser.add_argument(
        "--grace",
        metavar="S",
        type=_arg_seconds,
        default=KILL_GRACE_S,
        help=f"seconds between forwarding SIGINT/SIGTERM and killing what is left, and with "
        f"--heal between the ranks marking training finished and stopping a job that "
        f"did not end (default {KILL_GRACE_S:g}; leave preempted ranks time to checkpoint)",
    )
    parser.add_argument("--dry-run", action="store_true", help="run the checks, print the command, do not launch")
    parser.add_argument("script", help="Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser
