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

Steps 1 to 3 are :func:`_prepare` (the arguments are parsed in :mod:`.arguments`, the checks live
in :mod:`.hosts` and :mod:`.checks`, the command in :mod:`.command`, the plan it makes in
:mod:`.plan`, the topology in :mod:`.topology`); steps 4 and 5 are
:func:`.relaunch.run_with_restarts` (running in :mod:`.process`, the restart policy in
:mod:`.restarts`).

The launcher package imports only the standard library: the launcher must start fast, and it must
not initialise MPI itself (the mpi4py check runs in a subprocess).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence

from .arguments import USAGE, build_parser
from .checks import check_heal, check_mpi4py, check_mpi_match, check_script, describe_library
from .command import FLAVOR_NAMES, LaunchSpec, build_command
from .errors import PROG, LaunchError
from .healing import SPARES_ENV
from .hosts import check_hosts_resolve, parse_host, read_hostfile
from .plan import LaunchPlan, choose_launcher, open_mpi_permissions, topology_lines
from .relaunch import relaunch_plan, run_with_restarts
from .restarts import RESUME_ENV, RestartPolicy

__all__ = ["USAGE", "build_parser", "main"]

# The names these were defined under here, before the plan and the relaunch got modules of their
# own; the launcher's tests call them through this module.
_Plan = LaunchPlan
_relaunch_plan = relaunch_plan


def _prepare(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchPlan:
    """Run every sanity check and build the command; raises :class:`LaunchError`."""
    notes: list[str] = []
    check_script(args.script)
    RestartPolicy(args.max_restarts, args.min_ranks).check(args.nprocs)
    hostfile = read_hostfile(args.hostfile) if args.hostfile else None
    entries = list(hostfile.entries) if hostfile else [parse_host(h) for h in (args.hosts or ())]
    if entries:
        check_hosts_resolve([e.name for e in entries])
    launcher, flavor = choose_launcher(args.mpiexec, environ)
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
    oversubscribe, as_root = open_mpi_permissions(args, flavor, entries, notes)

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
            hang_timeout=args.hang_timeout or None,
            freeze_timeout=args.freeze_timeout or None,
        )
        command = build_command(spec, flavor)
    except ValueError as exc:
        raise LaunchError(f"{exc}") from None

    library_name = describe_library(library)
    topology = topology_lines(spec, flavor, entries, environ, library_name)
    if args.spares:
        topology[0] += f"; the last {args.spares} of them spare{'s' if args.spares > 1 else ''}, waiting"
    return LaunchPlan(spec, flavor, command, topology, notes, tuple(entries), library_name)


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
        return run_with_restarts(plan, args, os.environ)
    except OSError as exc:  # the launcher vanished or is not executable after the checks
        return _error(parser, f"cannot start {plan.command[0]}: {exc}")
