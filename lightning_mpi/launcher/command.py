"""The launch spec and the pure function that turns it into an MPICH hydra, Open MPI or
srun command line.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from typing import Literal

from .hosts import parse_host

__all__ = ["ENV_KEY", "FLAVORS", "FLAVOR_NAMES", "Flavor", "LaunchSpec", "build_command"]

#: Command-line syntax of the launcher: MPICH hydra's ``mpiexec``, Open MPI's ``mpirun``, or ``srun``.
Flavor = Literal["mpich", "openmpi", "srun"]
FLAVORS: tuple[str, ...] = ("mpich", "openmpi", "srun")
FLAVOR_NAMES = {"mpich": "MPICH (hydra)", "openmpi": "Open MPI", "srun": "Slurm srun"}

#: A shell variable name: what ``--env`` and :attr:`LaunchSpec.env` accept as a key.
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: ``--hang-timeout``'s default: seconds without a heartbeat before Open MPI's detector declares a
#: rank failed. The survivors train again about this long after a rank hung; a live rank that holds
#: Python's lock for longer (a loaded machine's start-up) is taken for a hung one (docs/faults.md,
#: "Hung ranks").
HANG_TIMEOUT = 8.0
#: heartbeats per timeout (Open MPI wants the timeout above 3 periods)
DETECTOR_BEATS = 5
#: ``mpi_add_procs_cutoff`` under the detector: jobs up to this many processes make every peer's
#: endpoint in ``MPI_Init`` (Open MPI's default, 0, makes each at the first message to that peer)
ADD_PROCS_CUTOFF = 1_000_000
#: how an Open MPI rank that waits gives up its core in an oversubscribed job (Open MPI then yields
#: between polls, whatever ``mpi_yield_when_idle`` says): a sleep of microseconds, not ``sched_yield``.
#: Under Linux's EEVDF scheduler (6.6 on) a process that polls with ``sched_yield`` can be left off
#: its core for seconds (measured: 8 ranks and 2 spares on 2 cores, 6-40 s with no CPU time while
#: runnable, so that Open MPI's detector declared live ranks failed, docs/faults.md)
YIELD_STRATEGY = "nanosleep"
#: ``--freeze-timeout``'s default: seconds a rank's process may stay stopped (``SIGSTOP``) while the
#: others go on before the process beside it kills it, so that the run heals it at once
#: (docs/faults.md, "Hung ranks"; ``lightning_mpi.comm.watchdog``)
FREEZE_TIMEOUT = 1.0
#: how it reaches the ranks (``lightning_mpi.comm.liveness`` reads it)
FREEZE_TIMEOUT_ENV = "LIGHTNING_MPI_FREEZE_TIMEOUT"


@dataclass(frozen=True)
class LaunchSpec:
    """Everything :func:`build_command` needs, validated at construction.

    - ``nprocs``: number of ranks, >= 1.
    - ``script`` / ``script_args``: what every rank runs, as ``python script args...``.
    - ``hosts``: ``"name"`` or ``"name:slots"`` strings; ``hostfile``: a path. At most one of them.
    - ``ppn``: ranks per node (>= 1), or ``None`` to leave placement to slots / the launcher.
    - ``env``: ``(KEY, VALUE)`` pairs exported to every rank on top of the inherited environment.
    - ``launcher``: the ``mpiexec`` / ``mpirun`` / ``srun`` executable that starts the job.
    - ``python``: the interpreter of the ranks; defaults to ``sys.executable``.
    - ``oversubscribe``: allow more ranks than cores or slots (hydra always does; Open MPI and
      srun refuse unless told).
    - ``as_root``: the job runs as root (Open MPI refuses unless told; hydra and srun do not mind).
    - ``heal``: launch with ULFM fault tolerance, so that the job survives a rank's death and the
      survivors can heal (Open MPI only: see :func:`build_command`), without Open MPI's
      hierarchical collectives (``coll/han``: their lazily made node communicators deadlocked on a
      healed communicator).
    - ``hang_timeout``: with ``heal``, seconds after which a rank that stopped answering (a frozen
      process, a lost host) is declared failed by Open MPI's heartbeat detector, which beats every
      ``hang_timeout / 5`` seconds and passes what it finds on to every rank at once
      (``mpi_ft_propagator_with_rbcast``: without it a failure that a spare detected reached no
      training rank, and 8 ranks waited on a cut-off host for good); ``None``: the detector stays off
      (a lost rank is then noticed only when its process ends). With the detector on, the ranks are
      numbered round-robin over the hosts (:attr:`ranks_by_node`).
    - ``freeze_timeout``: with ``heal`` and the detector, seconds a rank's process may stay stopped
      (``SIGSTOP``; ``SIGTTIN`` from reading the terminal in the background) while the other ranks
      go on, before the process beside it kills it, which the run heals at once; ``None``: never (a
      stopped rank is then found by the detector).

    Invalid values raise ``ValueError`` naming the field and the value.
    """

    nprocs: int
    script: str
    script_args: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    hostfile: str | None = None
    ppn: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    launcher: str = "mpiexec"
    python: str = field(default_factory=lambda: sys.executable)
    oversubscribe: bool = False
    as_root: bool = False
    heal: bool = False
    hang_timeout: float | None = HANG_TIMEOUT
    freeze_timeout: float | None = FREEZE_TIMEOUT

    @property
    def ranks_by_node(self) -> bool:
        """Whether the ranks are numbered round-robin over the hosts (rank ``r`` on host ``r % H``
        while every host has ranks left): under ``heal`` with the detector, on hosts. Open MPI's
        detector is a ring in which rank ``r + 1`` watches rank ``r``, and it watches the next rank
        only once it has declared the first one failed: with a host's ranks consecutive, the ranks
        of a host cut off were found one detector timeout after the other (measured: a host of 2
        of 8 ranks, 17.3 s after a 15 s cut at an 8 s timeout, after the link was back). Numbered
        round-robin, every rank is watched from another host, and a host cut off is found in one
        timeout. The cost: a flat ring collective crosses between hosts at every hop; the
        hierarchical rules find each host's ranks by ``Split_type`` and do not mind."""
        return self.heal and self.hang_timeout is not None and bool(self.hosts or self.hostfile)

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples, so the spec stays hashable and frozen.
        object.__setattr__(self, "script_args", tuple(self.script_args))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "env", tuple((k, v) for k, v in self.env))
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 1:
            raise ValueError(f"nprocs={self.nprocs!r}: must be an integer >= 1")
        if self.ppn is not None and (isinstance(self.ppn, bool) or not isinstance(self.ppn, int) or self.ppn < 1):
            raise ValueError(f"ppn={self.ppn!r}: must be an integer >= 1 or None")
        if self.hosts and self.hostfile:
            raise ValueError("hosts and hostfile: give at most one of them")
        if self.hang_timeout is not None and not self.hang_timeout > 0:
            raise ValueError(
                f"hang_timeout={self.hang_timeout!r}: must be a number of seconds > 0, or None (no detector)"
            )
        if self.freeze_timeout is not None and not self.freeze_timeout > 0:
            raise ValueError(
                f"freeze_timeout={self.freeze_timeout!r}: must be a number of seconds > 0, or None (never kill a "
                "stopped rank)"
            )
        for host in self.hosts:
            parse_host(host)  # raises ValueError naming the bad host
        for key, _ in self.env:
            if not ENV_KEY.match(key):
                raise ValueError(f"env key {key!r}: must be a shell variable name like MY_VAR")
        if not self.script:
            raise ValueError("script: must not be empty")


def build_command(spec: LaunchSpec, flavor: Flavor) -> list[str]:
    """Return the argv that launches ``spec`` with ``flavor``'s command-line syntax.

    Pure: reads no files and no environment, so every flavor is unit-testable anywhere.

    - ``"mpich"`` (hydra): ``mpiexec -n N [-hosts a,b | -f F] [-ppn K] [-genv K V]... python script args``.
      Hydra oversubscribes and runs as root by itself; it cannot heal (``ValueError``).
    - ``"openmpi"``: ``mpirun -np N [--with-ft ulfm --mca coll ^han] [--oversubscribe --mca
      threads_pthreads_yield_strategy nanosleep] [--allow-run-as-root] --bind-to none
      [--host a:S,b:S | --hostfile F] [--map-by ppr:K:node [--rank-by node] | node]
      [-x K=V]... python script args``, with the detector's settings and ``-x
      LIGHTNING_MPI_FREEZE_TIMEOUT=S`` after ``--with-ft``; oversubscribed, a rank that waits sleeps
      between polls (:data:`YIELD_STRATEGY`). Hosts without explicit slots get ``S =
      K`` (with ``ppn``) or ``S = ceil(N / hosts)`` plus ``--map-by node``, so ranks go round-robin over hosts as hydra
      places them; hosts of one slot each get ``--map-by node`` too (oversubscribed, the extra ranks
      then wrap around as in hydra). Under ``heal`` with the detector, ranks are numbered
      round-robin over the hosts whatever their slots (:attr:`LaunchSpec.ranks_by_node`: ``--map-by
      node``, or ``--rank-by node`` after ``--map-by ppr:K:node``). ``--bind-to none`` as hydra
      does: Open MPI would otherwise bind each of up to two ranks to a single core, and torch's
      threads of a rank would share that core.
    - ``"srun"``: ``srun --ntasks=N [--nodes=H --nodelist=a,b] [--ntasks-per-node=K] [--overcommit]
      [--export=ALL,K=V,...] --kill-on-bad-exit=1 python script args``. Slurm owns the slots,
      so a hostfile must be turned into ``hosts`` first (``ValueError`` otherwise); values with
      commas cannot be expressed in ``--export`` and raise ``ValueError``; it cannot heal.
    """
    if spec.heal and flavor != "openmpi":
        raise ValueError(
            f"heal=True: {FLAVOR_NAMES.get(flavor, flavor)} cannot keep a job running when a rank dies; "
            "healing needs Open MPI's mpirun with ULFM (--with-ft ulfm)"
        )
    program = [spec.python, spec.script, *spec.script_args]
    if flavor == "mpich":
        cmd = [spec.launcher, "-n", str(spec.nprocs)]
        if spec.hosts:
            cmd += ["-hosts", ",".join(spec.hosts)]
        if spec.hostfile:
            cmd += ["-f", spec.hostfile]
        if spec.ppn:
            cmd += ["-ppn", str(spec.ppn)]
        for key, value in spec.env:
            cmd += ["-genv", key, value]
        return cmd + program
    if flavor == "openmpi":
        cmd = [spec.launcher, "-np", str(spec.nprocs)]
        if spec.heal:
            cmd += ["--with-ft", "ulfm"]
            # HAN (hierarchical collectives) makes its node communicators inside the first collective
            # on a communicator: on a healed one, with 2 ranks per host, the ranks deadlocked there
            # (some in ompi_comm_nextcid, one in ompi_comm_activate: spares never let in)
            cmd += ["--mca", "coll", "^han"]
            if spec.hang_timeout is not None:  # heartbeats (comm.liveness keeps a live rank beating)
                period = spec.hang_timeout / DETECTOR_BEATS
                cmd += ["--mca", "mpi_ft_detector", "true"]
                cmd += ["--mca", "mpi_ft_detector_period", f"{period:g}"]
                cmd += ["--mca", "mpi_ft_detector_timeout", f"{spec.hang_timeout:g}"]
                cmd += ["--mca", "mpi_ft_propagator_with_rbcast", "true"]
                # every peer's endpoint made in MPI_Init, not at the first message to it: a rank that
                # first wrote to a peer of a host cut off (forwarding the news of a failure is such a
                # message) waited inside PMIx_Get for that host's address until the link was back,
                # sent no heartbeat meanwhile, and was declared failed with it (measured: 8 ranks on
                # 4 hosts, one cut for 15 s, a live host's 2 ranks stuck 14 s)
                cmd += ["--mca", "mpi_add_procs_cutoff", str(ADD_PROCS_CUTOFF)]
                cmd += ["-x", f"{FREEZE_TIMEOUT_ENV}={spec.freeze_timeout or 0:g}"]  # 0: off
        if spec.oversubscribe:
            # Open MPI then yields between polls: by a short sleep (YIELD_STRATEGY)
            cmd += ["--oversubscribe", "--mca", "threads_pthreads_yield_strategy", YIELD_STRATEGY]
        if spec.as_root:
            cmd.append("--allow-run-as-root")
        cmd += ["--bind-to", "none"]
        entries = [parse_host(h) for h in spec.hosts]
        if entries:
            default_slots = spec.ppn or math.ceil(spec.nprocs / len(entries))
            cmd += ["--host", ",".join(f"{e.name}:{e.slots or default_slots}" for e in entries)]
        if spec.hostfile:
            cmd += ["--hostfile", spec.hostfile]
        if spec.ppn:
            cmd += ["--map-by", f"ppr:{spec.ppn}:node"]
            if spec.ranks_by_node:
                cmd += ["--rank-by", "node"]
        elif spec.ranks_by_node or (
            entries and (all(e.slots is None for e in entries) or all(e.slots == 1 for e in entries))
        ):
            # one slot per host: by node is the plan's round-robin, also past the slots (Open MPI's
            # default, by slot, then fills the first hosts with the extra ranks: 5 ranks on a:1,b:1,c:1
            # went 0,1 | 2,3 | 4 instead of 0,3 | 1,4 | 2)
            cmd += ["--map-by", "node"]
        for key, value in spec.env:
            cmd += ["-x", f"{key}={value}"]
        return cmd + program
    if flavor == "srun":
        if spec.hostfile:
            raise ValueError("srun takes no hostfile here: parse it (read_hostfile) and pass hosts=... instead")
        cmd = [spec.launcher, f"--ntasks={spec.nprocs}"]
        if spec.hosts:
            names = [parse_host(h).name for h in spec.hosts]
            cmd += [f"--nodes={len(names)}", f"--nodelist={','.join(names)}"]
        if spec.ppn:
            cmd.append(f"--ntasks-per-node={spec.ppn}")
        if spec.oversubscribe:
            cmd.append("--overcommit")
        if spec.env:
            bad = [k for k, v in spec.env if "," in v]
            if bad:
                raise ValueError(f"env {bad[0]}: srun --export cannot carry a value with ','")
            cmd.append("--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in spec.env)]))
        # One failing rank ends the step instead of leaving the others waiting in a collective;
        # hydra and Open MPI behave this way by default.
        cmd.append("--kill-on-bad-exit=1")
        return cmd + program
    raise ValueError(f"flavor={flavor!r}: expected one of {', '.join(FLAVORS)}")
