"""Running the planned job, and launching it again while it fails and ``--max-restarts`` allows.

:func:`run_with_restarts` is step 4 and 5 of :mod:`.cli`: it runs the plan's command
(:func:`.process.run_job`), reads a healed job's outcome (:mod:`.healing`), and decides with
:func:`.restarts.should_restart` whether to launch again. Each relaunch gets a plan of its own
(:func:`relaunch_plan`): the ranks of hosts that were lost dropped, within ``--min-ranks``, and
``LIGHTNING_MPI_RESTART=k`` exported, so that the ranks resume from the newest common checkpoint.
The policy (what counts as lost, how many ranks are left) is :mod:`.restarts`; this module only
runs it. Everything is reported on stderr with the ``lightning-mpi:`` prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence

from .command import build_command
from .errors import PROG, LaunchError
from .healing import HEAL_OUTCOME_ENV, OutcomeDir, healed_exit_code, marked_finished
from .hosts import HostEntry
from .plan import LaunchPlan, topology_lines
from .process import run_job
from .restarts import RESTART_ENV, RestartPolicy, describe_exit, lost_hosts, ranks_left, should_restart

__all__ = ["job_environ", "relaunch_plan", "run_with_restarts"]


def relaunch_plan(
    plan: LaunchPlan, attempt: int, policy: RestartPolicy, hostfile: str | None, environ: Mapping[str, str]
) -> LaunchPlan:
    """The plan of relaunch ``attempt``: the ranks on lost hosts dropped (when ``policy`` allows
    it, else :class:`LaunchError`), and ``LIGHTNING_MPI_RESTART=attempt`` exported to every rank.
    ``hostfile`` (the ``--hostfile`` given, if any) is re-read to find hosts that were removed."""
    spec, entries = plan.spec, plan.entries
    env = tuple(kv for kv in spec.env if kv[0] != RESTART_ENV) + ((RESTART_ENV, str(attempt)),)
    notes: list[str] = []
    lost = lost_hosts(entries, hostfile) if entries else {}
    if lost:
        nprocs = ranks_left(spec.nprocs, entries, spec.ppn, list(lost), spec.ranks_by_node)
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
    topology = topology_lines(spec, plan.flavor, entries, environ, plan.library)
    return LaunchPlan(spec, plan.flavor, command, topology, notes, entries, plan.library)


def job_environ(hosts: Sequence[HostEntry]) -> dict[str, str] | None:
    """This process's environment for the job. With ``hosts`` (possibly other machines), without
    the MPI defaults that ``import lightning_mpi`` chose for this host
    (``lightning_mpi.comm.mpienv.APPLIED``): every rank chooses its own on its host. ``None``
    (inherit as it is) otherwise."""
    # Read from sys.modules, not imported: the launcher must not import lightning_mpi (torch, MPI).
    mpienv = sys.modules.get("lightning_mpi.comm.mpienv")
    applied = getattr(mpienv, "APPLIED", None) or {}
    if not applied or not hosts:
        return None
    return {k: v for k, v in os.environ.items() if applied.get(k) != v}


def run_with_restarts(plan: LaunchPlan, args: argparse.Namespace, environ: Mapping[str, str]) -> int:
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
                command, grace_s=args.grace, sigint_as=sigint_as, env=job_environ(plan.entries), finished=finished
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
            plan = relaunch_plan(plan, attempt, policy, args.hostfile, environ)
        except LaunchError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return outcome.code
        for line in plan.notes:
            print(f"{PROG}: note: {line}", file=sys.stderr)
        for line in plan.topology:
            print(f"{PROG}: {line}", file=sys.stderr)
