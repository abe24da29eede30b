"""A launch plan: the command to run, and what is printed about it before it runs.

:class:`LaunchPlan` is what the checks produce (:func:`.cli.main`, step 3) and what a relaunch
derives anew (:func:`.relaunch.relaunch_plan`): the :class:`~.command.LaunchSpec`, the launcher's
flavor, the command built from them, the topology lines and notes to print, and the hosts and MPI
library they were planned for. The helpers here pick the launcher, decide what Open MPI must be
told that hydra does by itself, and word the topology; none of them starts a process other than
``mpiexec --version``.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .checks import find_mpiexec, flavor_from_version, mpiexec_version
from .command import FLAVOR_NAMES, Flavor, LaunchSpec
from .hosts import HostEntry
from .topology import format_topology, oversubscribed, plan_topology

__all__ = ["LaunchPlan", "choose_launcher", "open_mpi_permissions", "topology_lines"]


@dataclass(frozen=True)
class LaunchPlan:
    """One launch: ``command`` (built from ``spec`` for ``flavor``) and the lines printed before it."""

    spec: LaunchSpec
    flavor: Flavor
    command: list[str]
    topology: list[str]
    notes: list[str]
    #: the hosts as given (a relaunch drops the lost ones from them)
    entries: tuple[HostEntry, ...] = ()
    #: the MPI library mpi4py loads, as printed (checked once; a relaunch reuses it)
    library: str = ""


def choose_launcher(explicit: str | None, environ: Mapping[str, str]) -> tuple[str, Flavor | None]:
    """srun inside a Slurm allocation unless --mpiexec is given; else mpiexec and its flavor."""
    if not explicit and environ.get("SLURM_JOB_ID"):
        srun = shutil.which("srun", path=environ.get("PATH", os.defpath))
        if srun:
            return srun, "srun"
    launcher = find_mpiexec(explicit, environ)
    return launcher, flavor_from_version(mpiexec_version(launcher))


def open_mpi_permissions(
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


def topology_lines(
    spec: LaunchSpec, flavor: Flavor, entries: Sequence[HostEntry], environ: Mapping[str, str], library: str = ""
) -> list[str]:
    """The lines printed before a launch: how many ranks via which launcher and MPI, and where."""
    header = f"{spec.nprocs} rank{'s' if spec.nprocs != 1 else ''} via {FLAVOR_NAMES[flavor]} ({spec.launcher})"
    if library:
        header += f", MPI library {library}"
    if spec.heal:
        header += ", healing on (ULFM)"
    if flavor == "srun" and not (entries and spec.ppn):
        # Slurm decides the placement itself: say where it may put them, not a plan it may not follow.
        where = ",".join(e.name for e in entries) or environ.get("SLURM_JOB_NODELIST", "the allocation")
        per_node = f", at most {spec.ppn} per node" if spec.ppn else ""
        return [header, f"Slurm places them on {where}{per_node}"]
    return [header, *format_topology(plan_topology(spec.nprocs, entries, spec.ppn, spec.ranks_by_node))]
