"""``lightning-mpi``: an ``mpiexec`` front end with sanity checks (after PowerAI DDL's ``ddlrun``).

Usage::

    lightning-mpi -n N [--hosts a,b | --hostfile F] [--ppn K] [--mpiexec PATH]
                  [--env K=V]... [--oversubscribe] [--heal [--spares K]] [--max-restarts R [--min-ranks M]]
                  [--resume] [--grace S] [--dry-run] script.py [script args]
    python -m lightning_mpi ...          # the same

What it does, in order:

1. Checks the arguments and the environment, and stops with exit code 2 and a message that
   names the problem and the fix when one fails: N >= 1, the script exists, the hostfile parses,
   every host resolves, a launcher is found, ``mpi4py`` imports and loads its MPI library,
   that library belongs to the same MPI as the ``mpiexec`` found (the venv's first, then PATH),
   and, with ``--heal``, that this MPI can keep a job running after a rank died (Open MPI's ULFM).
2. Picks the launcher: ``srun`` inside a Slurm allocation (``SLURM_JOB_ID`` set and ``srun`` on
   PATH) unless ``--mpiexec`` is given; otherwise ``mpiexec``, whose command-line syntax (MPICH
   hydra or Open MPI) is read from ``mpiexec --version``.
3. Builds the command with the pure function :func:`.command.build_command` and prints the planned
   topology (the MPI, hosts and ranks per host) on stderr. The same options work with either MPI:
   what hydra does by itself and Open MPI refuses unless told (more ranks than cores or slots,
   running as root) is passed to Open MPI with a note. ``--dry-run`` prints the command on stdout
   and exits 0 without launching.
4. Runs the command in its own session and returns its exit code (death by signal S gives
   128 + S). SIGINT/SIGTERM are forwarded; whatever is still alive after ``--grace`` seconds,
   ranks included, is killed. SIGUSR1 (a preemption notice) is forwarded as it is.
5. With ``--max-restarts R``, a job that failed is launched again, up to R times, each time with
   ``LIGHTNING_MPI_RESTART=k`` exported to the ranks (they resume from the newest common
   checkpoint); ``--min-ranks M`` lets a relaunch go on with fewer ranks when hosts were lost.
6. With ``--heal --spares K``, K more ranks are launched after the N that train, with
   ``LIGHTNING_MPI_SPARES=K`` exported: they wait, idle, and take the place of lost ranks at once
   under ``heal="replace"`` (``lightning_mpi.comm.spares``).

Steps 1 to 3 are :func:`_prepare` (the checks live in :mod:`.hosts` and :mod:`.checks`, the command
in :mod:`.command`, the topology in :mod:`.topology`); step 4 is :func:`.process.run_job`; step 5
is :func:`_run_with_restarts` (the policy lives in :mod:`.restarts`).

The launcher package imports only the standard library: the launcher must start fast, and it must
not initialise MPI itself (the mpi4py check runs in a subprocess).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .checks import (
    check_heal,
    check_mpi4py,
    check_mpi_match,
    check_script,
    describe_library,
    find_mpiexec,
    flavor_from_version,
    mpiexec_version,
)
from .command import ENV_KEY, FLAVOR_NAMES, Flavor, LaunchSpec, build_command
from .errors import PROG, LaunchError
from .healing import HEAL_OUTCOME_ENV, SPARES_ENV, OutcomeDir, healed_exit_code, marked_finished
from .hosts import HostEntry, check_hosts_resolve, parse_host, positive_int, read_hostfile
from .process import KILL_GRACE_S, run_job
from .restarts import RESTART_ENV, RESUME_ENV, RestartPolicy, describe_exit, lost_hosts, ranks_left, should_restart
from .topology import format_topology, oversubscribed, plan_topology

__all__ = ["USAGE", "build_parser", "main"]

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


@dataclass(frozen=True)
class _Plan:
    spec: LaunchSpec
    flavor: Flavor
    command: list[str]
    topology: list[str]
    notes: list[str]
    entries: tuple[HostEntry, ...] = ()
    library: str = ""


def _choose_launcher(explicit: str | None, environ: Mapping[str, str]) -> tuple[str, Flavor | None]:
    """srun inside a Slurm allocation unless --mpiexec is given; else mpiexec and its flavor."""
    if not explicit and environ.get("SLURM_JOB_ID"):
        srun = shutil.which("srun", path=environ.get("PATH", os.defpath))
        if srun:
            return srun, "srun"
    launcher = find_mpiexec(explicit, environ)
    return launcher, flavor_from_version(mpiexec_version(launcher))


def _prepare(args: argparse.Namespace, environ: Mapping[str, str]) -> _Plan:
    """Run every sanity check and build the command; raises :class:`LaunchError`."""
    notes: list[str] = []
    check_script(args.script)
    RestartPolicy(args.max_restarts, args.min_ranks).check(args.nprocs)
    hostfile = read_hostfile(args.hostfile) if args.hostfile else None
    entries = list(hostfile.entries) if hostfile else [parse_host(h) for h in (args.hosts or ())]
    if entries:
        check_hosts_resolve([e.name for e in entries])
    launcher, flavor = _choose_launcher(args.mpiexec, environ)
    library = check_mpi4py(sys.executable)
    notes += check_mpi_match(library, launcher, flavor)
    assert flavor is not None  # check_mpi_match raised otherwise
    if args.heal:
        check_heal(flavor, launcher)
    if args.spares and not args.heal:
        raise LaunchError(
            f"argument --spares: {args.spares} spare ranks without --heal would only wait; spares take the place "
            "of lost ranks in a job that heals; fix: add --heal (and heal='replace' to the strategy), or drop --spares"
        )
    total = args.nprocs + args.spares  # the spares are the job's last ranks
    oversubscribe, as_root = _open_mpi_permissions(args, flavor, entries, notes)

    hosts = tuple(args.hosts or ())
    hostfile_path = args.hostfile
    if hostfile is not None and (flavor == "srun" or hostfile.syntax not in ("plain", flavor)):
        # srun has no hostfile option of this form, and hydra / Open MPI each reject the other's
        # slot syntax: hand the parsed hosts over on the command line, which both understand.
        hosts, hostfile_path = tuple(str(e) for e in entries), None
        notes.append(f"hostfile {args.hostfile!r} passed as a host list for {FLAVOR_NAMES[flavor]}")
    try:
        spec = LaunchSpec(
            nprocs=total,
            script=args.script,
            script_args=tuple(args.script_args),
            hosts=hosts,
            hostfile=hostfile_path,
            ppn=args.ppn,
            env=tuple(args.env)
            + (((RESUME_ENV, "1"),) if args.resume else ())
            + (((SPARES_ENV, str(args.spares)),) if args.spares else ()),
            launcher=launcher,
            oversubscribe=oversubscribe,
            as_root=as_root,
            heal=args.heal,
        )
        command = build_command(spec, flavor)
    except ValueError as exc:
        raise LaunchError(f"{exc}") from None

    library_name = describe_library(library)
    topology = _topology(spec, flavor, entries, environ, library_name)
    if args.spares:
        topology[0] += f"; the last {args.spares} of them spare{'s' if args.spares > 1 else ''}, waiting"
    return _Plan(spec, flavor, command, topology, notes, tuple(entries), library_name)


def _open_mpi_permissions(
    args: argparse.Namespace, flavor: Flavor, entries: Sequence[HostEntry], notes: list[str]
) -> tuple[bool, bool]:
    """``(oversubscribe, as_root)`` for the command: what hydra does by itself and Open MPI only
    when told, so that one command line works with either MPI. Adds a note for each one passed
    without being asked for."""
    oversubscribe = args.oversubscribe
    if flavor != "openmpi":
        return oversubscribe, False
    if not oversubscribe:
        why = oversubscribed(args.nprocs + args.spares, entries, args.ppn, os.cpu_count() or 1)
        if why:
            oversubscribe = True
            notes.append(f"{why}: passing --oversubscribe to Open MPI (hydra oversubscribes by itself)")
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if as_root:
        notes.append("running as root: passing --allow-run-as-root to Open MPI (hydra runs as root by itself)")
    return oversubscribe, as_root


def _topology(
    spec: LaunchSpec, flavor: Flavor, entries: Sequence[HostEntry], environ: Mapping[str, str], library: str = ""
) -> list[str]:
    """The lines printed before a launch: how many ranks via which launcher and MPI, and where."""
    header = f"{spec.nprocs} rank{'s' if spec.nprocs != 1 else ''} via {FLAVOR_NAMES[flavor]} ({spec.launcher})"
    if library:
        header += f", MPI library {library}"
    if spec.heal:
        header += ", healing on (ULFM)"
    if flavor == "srun" and not (entries and spec.ppn):
        where = ",".join(e.name for e in entries) or environ.get("SLURM_JOB_NODELIST", "the allocation")
        per_node = f", at most {spec.ppn} per node" if spec.ppn else ""
        return [header, f"Slurm places them on {where}{per_node}"]
    return [header, *format_topology(plan_topology(spec.nprocs, entries, spec.ppn))]


def _relaunch_plan(
    plan: _Plan, attempt: int, policy: RestartPolicy, hostfile: str | None, environ: Mapping[str, str]
) -> _Plan:
    """The plan of relaunch ``attempt``: the ranks on lost hosts dropped (when ``policy`` allows
    it, else :class:`LaunchError`), and ``LIGHTNING_MPI_RESTART=attempt`` exported to every rank.
    ``hostfile`` (the ``--hostfile`` given, if any) is re-read to find hosts that were removed."""
    spec, entries = plan.spec, plan.entries
    env = tuple(kv for kv in spec.env if kv[0] != RESTART_ENV) + ((RESTART_ENV, str(attempt)),)
    notes: list[str] = []
    lost = lost_hosts(entries, hostfile) if entries else {}
    if lost:
        nprocs = ranks_left(spec.nprocs, entries, spec.ppn, list(lost))
        min_ranks = policy.min_ranks if policy.min_ranks is not None else spec.nprocs
        detail = "; ".join(f"{name} {why}" for name, why in lost.items())
        if nprocs < min_ranks:
            raise LaunchError(
                f"cannot relaunch: {detail}; {nprocs} of {spec.nprocs} ranks are left, fewer than "
                f"--min-ranks {min_ranks}; fix: bring the hosts back, or allow fewer ranks with --min-ranks"
            )
        entries = tuple(e for e in entries if e.name not in lost)
        notes.append(f"{detail}: relaunching on {nprocs} of {spec.nprocs} ranks")
        spec = dataclasses.replace(spec, nprocs=nprocs, hosts=tuple(str(e) for e in entries), hostfile=None)
    spec = dataclasses.replace(spec, env=env)
    try:
        command = build_command(spec, plan.flavor)
    except ValueError as exc:
        raise LaunchError(f"{exc}") from None
    topology = _topology(spec, plan.flavor, entries, environ, plan.library)
    return _Plan(spec, plan.flavor, command, topology, notes, entries, plan.library)


def _job_environ(hosts: Sequence[HostEntry]) -> dict[str, str] | None:
    """This process's environment for the job. With ``hosts`` (possibly other machines), without
    the MPI defaults that ``import lightning_mpi`` chose for this host
    (``lightning_mpi.comm.mpienv.APPLIED``): every rank chooses its own on its host. ``None``
    (inherit as it is) otherwise."""
    mpienv = sys.modules.get("lightning_mpi.comm.mpienv")
    applied = getattr(mpienv, "APPLIED", None) or {}
    if not applied or not hosts:
        return None
    return {k: v for k, v in os.environ.items() if applied.get(k) != v}


def _run_with_restarts(plan: _Plan, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Run the job; relaunch it while it fails and ``--max-restarts`` allows; return the last exit code."""
    policy = RestartPolicy(args.max_restarts, args.min_ranks)
    sigint_as = signal.SIGTERM if plan.flavor == "srun" else signal.SIGINT
    attempt = 0
    while True:
        with OutcomeDir() as outcome_dir:
            command = plan.command
            if args.heal:  # where the ranks mark that training finished (see .healing)
                spec = dataclasses.replace(plan.spec, env=plan.spec.env + ((HEAL_OUTCOME_ENV, outcome_dir),))
                command = build_command(spec, plan.flavor)
            print(f"{PROG}: command: {shlex.join(command)}", file=sys.stderr, flush=True)
            finished = (lambda: marked_finished(outcome_dir)) if args.heal else None
            outcome = run_job(
                command, grace_s=args.grace, sigint_as=sigint_as, env=_job_environ(plan.entries), finished=finished
            )
            code, note = healed_exit_code(outcome.code, outcome_dir if args.heal else None, outcome.ended_after_finish)
        if note:
            print(f"{PROG}: note: {note}", file=sys.stderr)
            outcome = dataclasses.replace(outcome, code=code)
        if outcome.notices and outcome.code == 0:
            print(
                f"{PROG}: the job ended after a preemption notice; if it stopped early, launch it again "
                "with --resume to continue from its checkpoint",
                file=sys.stderr,
            )
        if not should_restart(outcome.code, outcome.stopped_by, attempt, policy):
            if outcome.code != 0 and outcome.stopped_by is None and policy.max_restarts:
                print(
                    f"{PROG}: the job failed ({describe_exit(outcome.code)}) and all "
                    f"{policy.max_restarts} restarts are used up; giving up",
                    file=sys.stderr,
                )
            return outcome.code
        attempt += 1
        print(
            f"{PROG}: the job failed ({describe_exit(outcome.code)}); restart {attempt} of "
            f"{policy.max_restarts}, resuming from the newest checkpoint every rank can read",
            file=sys.stderr,
            flush=True,
        )
        try:
            plan = _relaunch_plan(plan, attempt, policy, args.hostfile, environ)
        except LaunchError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return outcome.code
        for line in plan.notes:
            print(f"{PROG}: note: {line}", file=sys.stderr)
        for line in plan.topology:
            print(f"{PROG}: {line}", file=sys.stderr)


def _error(parser: argparse.ArgumentParser, message: str) -> int:
    """Report like argparse does (usage line, then 'prog: error: ...') and return 2."""
    parser.print_usage(sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-mpi`` and ``python -m lightning_mpi``; returns the exit code.

    0/the job's exit code on a launch, 0 for ``--dry-run`` and ``--help``, 2 for a bad argument
    or a failed sanity check (message on stderr, with the fix), 128 + S when stopped by signal S.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        plan = _prepare(args, os.environ)
    except LaunchError as exc:
        return _error(parser, str(exc))
    except KeyboardInterrupt:  # Ctrl-C during the checks: nothing was launched yet
        return 128 + signal.SIGINT
    for line in plan.notes:
        print(f"{PROG}: note: {line}", file=sys.stderr)
    for line in plan.topology:
        print(f"{PROG}: {line}", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(plan.command))
        return 0
    try:
        return _run_with_restarts(plan, args, os.environ)
    except OSError as exc:  # the launcher vanished or is not executable after the checks
        return _error(parser, f"cannot start {plan.command[0]}: {exc}")
