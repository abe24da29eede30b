"""``lightning-mpi``: an ``mpiexec`` front end with sanity checks (after PowerAI DDL's ``ddlrun``).

Usage::

    lightning-mpi -n N [--hosts a,b | --hostfile F] [--ppn K] [--mpiexec PATH]
                  [--env K=V]... [--dry-run] script.py [script args]
    python -m lightning_mpi ...          # the same

What it does, in order:

1. Checks the arguments and the environment, and stops with exit code 2 and a message that
   names the problem and the fix when one fails: N >= 1, the script exists, the hostfile parses,
   every host resolves, a launcher is found, ``mpi4py`` imports and loads its MPI library, and
   that library belongs to the same MPI as the ``mpiexec`` found (the venv's first, then PATH).
2. Picks the launcher: ``srun`` inside a Slurm allocation (``SLURM_JOB_ID`` set and ``srun`` on
   PATH) unless ``--mpiexec`` is given; otherwise ``mpiexec``, whose command-line syntax (MPICH
   hydra or Open MPI) is read from ``mpiexec --version``.
3. Builds the command with the pure function :func:`build_command` and prints the planned
   topology (hosts and ranks per host) on stderr. ``--dry-run`` prints the command on stdout and
   exits 0 without launching.
4. Runs the command in its own session and returns its exit code (death by signal S gives
   128 + S). SIGINT/SIGTERM are forwarded; whatever is still alive after a grace period, ranks
   included, is killed.

This module imports only the standard library: the launcher must start fast, and it must not
initialise MPI itself (the mpi4py check runs in a subprocess).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Sequence

__all__ = [
    "Flavor",
    "HostEntry",
    "Hostfile",
    "LaunchError",
    "LaunchSpec",
    "build_command",
    "build_parser",
    "check_hosts_resolve",
    "check_mpi_match",
    "check_mpi4py",
    "check_script",
    "find_mpiexec",
    "flavor_from_version",
    "format_topology",
    "main",
    "parse_host",
    "parse_hostfile",
    "plan_topology",
    "read_hostfile",
    "run_command",
]

Flavor = Literal["mpich", "openmpi", "srun"]
FLAVORS: tuple[str, ...] = ("mpich", "openmpi", "srun")
FLAVOR_NAMES = {"mpich": "MPICH (hydra)", "openmpi": "Open MPI", "srun": "Slurm srun"}

PROG = "lightning-mpi"
USAGE = (
    "lightning-mpi -n N [--hosts a,b | --hostfile F] [--ppn K] [--mpiexec PATH] "
    "[--env K=V]... [--dry-run] script.py [script args]"
)

#: Seconds between forwarding SIGINT/SIGTERM and killing every remaining process with SIGKILL.
KILL_GRACE_S = 5.0
#: Seconds allowed for all host names to resolve together.
RESOLVE_TIMEOUT_S = 10.0
#: Seconds allowed for ``mpiexec --version`` and for the mpi4py probe.
PROBE_TIMEOUT_S = 30.0

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class LaunchError(Exception):
    """A sanity check failed. The message names the bad argument or value and says how to fix it."""


# --------------------------------------------------------------------------------------------
# Hosts and hostfiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostEntry:
    """One host, with the number of slots (ranks it takes per round) when given explicitly."""

    name: str
    slots: int | None = None

    def __str__(self) -> str:
        return self.name if self.slots is None else f"{self.name}:{self.slots}"


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return value


def parse_host(text: str) -> HostEntry:
    """Parse ``name`` or ``name:slots`` (the ``--hosts`` and MPICH hostfile syntax).

    Raises ``ValueError`` for an empty name or slots that are not a positive integer.
    """
    name, sep, slots = text.strip().partition(":")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"bad host {text!r}: expected 'name' or 'name:slots'")
    if not sep:
        return HostEntry(name)
    return HostEntry(name, _positive_int(slots, f"slots of host {name!r}"))


@dataclass(frozen=True)
class Hostfile:
    """A parsed hostfile: its entries in order, and which syntax it used.

    ``syntax`` is ``"mpich"`` (``host:slots``), ``"openmpi"`` (``host slots=K``) or ``"plain"``
    (bare host names, which both understand).
    """

    entries: tuple[HostEntry, ...]
    syntax: Literal["mpich", "openmpi", "plain"]


def parse_hostfile(text: str, source: str = "hostfile") -> Hostfile:
    """Parse hostfile text in MPICH (``host[:slots]``) or Open MPI (``host [slots=K] [max_slots=M]``)
    syntax; ``#`` starts a comment, blank lines are skipped.

    MPICH's extra ``key=value`` fields (e.g. ``ifhn=``) are accepted and ignored, as is Open MPI's
    ``max_slots``. Raises ``ValueError`` naming ``source`` and the line number for a malformed
    line, a file that mixes both syntaxes, or a file without hosts.
    """
    entries: list[HostEntry] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {lineno} ({raw.strip()!r})"
        slots: int | None = None
        try:
            if ":" in fields[0]:
                entry = parse_host(fields[0])
                name, slots, kind = entry.name, entry.slots, "mpich"
            else:
                name, kind = fields[0], "plain"
            for extra in fields[1:]:
                key, eq, value = extra.partition("=")
                if not eq:
                    raise ValueError(f"expected key=value after the host name, got {extra!r}")
                if key in ("slots", "max_slots", "max-slots"):
                    if kind == "mpich":
                        raise ValueError("mixes 'host:slots' with 'slots='; use one of them")
                    number = _positive_int(value, key)
                    if key == "slots":
                        slots, kind = number, "openmpi"
                # Any other key=value is an MPICH per-host option such as ifhn=eth0: kept by
                # the launcher itself when the file is passed through, not needed for planning.
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if kind != "plain":
            seen.add(kind)
        entries.append(HostEntry(name, slots))
    if not entries:
        raise ValueError(f"{source} lists no hosts")
    if len(seen) > 1:
        raise ValueError(
            f"{source} mixes MPICH 'host:slots' and Open MPI 'host slots=K' lines; use one syntax"
        )
    syntax = seen.pop() if seen else "plain"
    return Hostfile(tuple(entries), syntax)  # type: ignore[arg-type]


def read_hostfile(path: str) -> Hostfile:
    """Read and parse ``path`` (see :func:`parse_hostfile`); raises :class:`LaunchError` with the fix."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(
            f"argument --hostfile: cannot read {path!r} ({exc.strerror or exc}); "
            "fix: pass the path of an existing hostfile, one host per line"
        ) from None
    try:
        return parse_hostfile(text, source=f"hostfile {path!r}")
    except ValueError as exc:
        raise LaunchError(
            f"argument --hostfile: {exc}; fix: write one host per line as 'host', "
            "'host:slots' (MPICH) or 'host slots=K' (Open MPI)"
        ) from None


# --------------------------------------------------------------------------------------------
# The launch spec and the pure command builder
# --------------------------------------------------------------------------------------------


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

    def __post_init__(self) -> None:
        # Accept lists for convenience but store tuples, so the spec stays hashable and frozen.
        object.__setattr__(self, "script_args", tuple(self.script_args))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "env", tuple((k, v) for k, v in self.env))
        if isinstance(self.nprocs, bool) or not isinstance(self.nprocs, int) or self.nprocs < 1:
            raise ValueError(f"nprocs={self.nprocs!r}: must be an integer >= 1")
        if self.ppn is not None and (
            isinstance(self.ppn, bool) or not isinstance(self.ppn, int) or self.ppn < 1
        ):
            raise ValueError(f"ppn={self.ppn!r}: must be an integer >= 1 or None")
        if self.hosts and self.hostfile:
            raise ValueError("hosts and hostfile: give at most one of them")
        for host in self.hosts:
            parse_host(host)  # raises ValueError naming the bad host
        for key, _ in self.env:
            if not _ENV_KEY.match(key):
                raise ValueError(f"env key {key!r}: must be a shell variable name like MY_VAR")
        if not self.script:
            raise ValueError("script: must not be empty")


def build_command(spec: LaunchSpec, flavor: Flavor) -> list[str]:
    """Return the argv that launches ``spec`` with ``flavor``'s command-line syntax.

    Pure: reads no files and no environment, so every flavor is unit-testable anywhere.

    - ``"mpich"`` (hydra): ``mpiexec -n N [-hosts a,b | -f F] [-ppn K] [-genv K V]... python script args``
    - ``"openmpi"``: ``mpirun -np N [--host a:S,b:S | --hostfile F] [--map-by ppr:K:node | node]
      [-x K=V]... python script args``. Hosts without explicit slots get ``S = K`` (with ``ppn``)
      or ``S = ceil(N / hosts)`` plus ``--map-by node``, so ranks go round-robin over hosts as
      hydra places them.
    - ``"srun"``: ``srun --ntasks=N [--nodes=H --nodelist=a,b] [--ntasks-per-node=K]
      [--export=ALL,K=V,...] --kill-on-bad-exit=1 python script args``. Slurm owns the slots,
      so a hostfile must be turned into ``hosts`` first (``ValueError`` otherwise); values with
      commas cannot be expressed in ``--export`` and raise ``ValueError``.
    """
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
        entries = [parse_host(h) for h in spec.hosts]
        if entries:
            default_slots = spec.ppn or math.ceil(spec.nprocs / len(entries))
            cmd += ["--host", ",".join(f"{e.name}:{e.slots or default_slots}" for e in entries)]
        if spec.hostfile:
            cmd += ["--hostfile", spec.hostfile]
        if spec.ppn:
            cmd += ["--map-by", f"ppr:{spec.ppn}:node"]
        elif entries and all(e.slots is None for e in entries):
            cmd += ["--map-by", "node"]
        for key, value in spec.env:
            cmd += ["-x", f"{key}={value}"]
        return cmd + program
    if flavor == "srun":
        if spec.hostfile:
            raise ValueError(
                "srun takes no hostfile here: parse it (read_hostfile) and pass hosts=... instead"
            )
        cmd = [spec.launcher, f"--ntasks={spec.nprocs}"]
        if spec.hosts:
            names = [parse_host(h).name for h in spec.hosts]
            cmd += [f"--nodes={len(names)}", f"--nodelist={','.join(names)}"]
        if spec.ppn:
            cmd.append(f"--ntasks-per-node={spec.ppn}")
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


# --------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------


def plan_topology(
    nprocs: int, hosts: Sequence[HostEntry], ppn: int | None = None
) -> list[tuple[str, list[int]]]:
    """Where hydra places ``nprocs`` ranks: ``[(host, [ranks...]), ...]`` in host order.

    Hosts are visited round-robin; each visit takes ``ppn`` ranks if given, else the host's slots,
    else 1, until all ranks are placed (so more ranks than slots wrap around). A host listed
    twice is reported once. No hosts means one machine: ``[("localhost", [0..N-1])]``. The Open
    MPI command from :func:`build_command` places ranks the same way when they fit in the slots.
    """
    if not hosts:
        return [("localhost", list(range(nprocs)))]
    placed: dict[str, list[int]] = {e.name: [] for e in hosts}
    rank = 0
    while rank < nprocs:
        for entry in hosts:
            take = min(ppn or entry.slots or 1, nprocs - rank)
            placed[entry.name].extend(range(rank, rank + take))
            rank += take
            if rank == nprocs:
                break
    return list(placed.items())


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = r
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def format_topology(placement: Sequence[tuple[str, Sequence[int]]]) -> list[str]:
    """One line per host: ``"localhost: 2 ranks (0-1)"``."""
    lines = []
    for host, ranks in placement:
        count = len(ranks)
        noun = "rank" if count == 1 else "ranks"
        lines.append(f"{host}: {count} {noun}" + (f" ({_ranges(ranks)})" if ranks else ""))
    return lines


# --------------------------------------------------------------------------------------------
# Sanity checks
# --------------------------------------------------------------------------------------------


def check_script(script: str) -> None:
    """Fail unless ``script`` is an existing file."""
    if not Path(script).is_file():
        raise LaunchError(
            f"argument script: {script!r} not found (relative to {os.getcwd()}); "
            "fix: give the path of the Python script every rank should run"
        )


def check_hosts_resolve(names: Sequence[str], timeout: float = RESOLVE_TIMEOUT_S) -> None:
    """Fail unless every host name resolves with ``socket.gethostbyname``, within ``timeout`` s.

    Names are resolved in parallel daemon threads so that a slow DNS costs ``timeout`` once and
    cannot keep the process alive afterwards.
    """
    unique = list(dict.fromkeys(names))
    errors: dict[str, str] = {}

    def resolve(name: str) -> None:
        try:
            socket.gethostbyname(name)
        except OSError as exc:
            errors[name] = getattr(exc, "strerror", None) or str(exc)

    threads = [threading.Thread(target=resolve, args=(n,), daemon=True) for n in unique]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for name, t in zip(unique, threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.setdefault(name, f"no answer within {timeout:g} s")
    bad = [n for n in unique if n in errors]
    if bad:
        detail = "; ".join(f"{n!r}: {errors[n]}" for n in bad)
        raise LaunchError(
            f"host does not resolve: {detail}; fix: correct the name in --hosts/--hostfile, "
            "add it to /etc/hosts or DNS, or give its IP address"
        )


def find_mpiexec(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The launcher executable: ``explicit`` (a path or a name on PATH) when given, else the
    venv's ``mpiexec`` (next to ``sys.executable``, where ``pip install mpich`` puts it), else
    ``mpiexec`` then ``mpirun`` on PATH. Raises :class:`LaunchError` with the fix.
    """
    path_var = (os.environ if environ is None else environ).get("PATH", os.defpath)
    if explicit:
        if os.sep in explicit:
            if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
                return explicit
        else:
            found = shutil.which(explicit, path=path_var)
            if found:
                return found
        raise LaunchError(
            f"argument --mpiexec: {explicit!r} is not an executable file; "
            "fix: pass the full path of the mpiexec/mpirun that belongs to mpi4py's MPI"
        )
    # Not resolved through symlinks: a venv's python is a symlink, its bin/ is the venv's.
    venv_mpiexec = Path(sys.executable).parent / "mpiexec"
    if venv_mpiexec.is_file() and os.access(venv_mpiexec, os.X_OK):
        return str(venv_mpiexec)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=path_var)
        if found:
            return found
    raise LaunchError(
        f"no mpiexec found in {venv_mpiexec.parent} or on PATH; "
        "fix: pip install mpich (puts mpiexec into this environment), or pass --mpiexec PATH"
    )


def flavor_from_version(text: str) -> Flavor | None:
    """Classify ``mpiexec --version`` or ``MPI.Get_library_version()`` text.

    ``"openmpi"`` for Open MPI / ORTE / PRRTE, ``"mpich"`` for MPICH and its hydra-based
    derivatives (Intel MPI, MVAPICH, Cray MPICH share the MPICH ABI and hydra syntax),
    ``"srun"`` for Slurm, ``None`` when unknown.
    """
    low = text.lower()
    if "open mpi" in low or "openmpi" in low or "openrte" in low or "prrte" in low or "prterun" in low:
        return "openmpi"
    if re.search(r"\borte\b", low):
        return "openmpi"
    if "hydra" in low or "mpich" in low or "intel(r) mpi" in low or "mvapich" in low:
        return "mpich"
    if re.search(r"\bslurm\b", low):
        return "srun"
    return None


def mpiexec_version(path: str) -> str:
    """Stdout and stderr of ``path --version``; :class:`LaunchError` when it cannot run."""
    try:
        out = subprocess.run(
            [path, "--version"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(
            f"cannot run {path} --version ({exc}); fix: pass --mpiexec PATH of a working mpiexec"
        ) from None
    return out.stdout + out.stderr


_PROBE = r"""
import json, sys
try:
    import mpi4py
except BaseException as exc:
    print(json.dumps({"stage": "mpi4py", "error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
# Only read the library version: MPI_Init belongs to the ranks, and a singleton init here
# could start a process manager of its own.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
try:
    from mpi4py import MPI
    library = MPI.Get_library_version()
except BaseException as exc:
    print(json.dumps({"stage": "MPI", "error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
print(json.dumps({"stage": "ok", "library": library, "mpi4py": mpi4py.__version__}))
"""


def check_mpi4py(python: str | None = None) -> str:
    """Fail unless ``mpi4py`` imports and loads its MPI library in ``python`` (default
    ``sys.executable``, the ranks' interpreter); return ``MPI.Get_library_version()``.

    Runs in a subprocess so that the launcher never loads or initialises MPI itself.
    """
    python = python or sys.executable
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run {python} to check mpi4py ({exc})") from None
    lines = proc.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise LaunchError(
            f"mpi4py check crashed in {python} (exit {proc.returncode}): {tail}; "
            "fix: pip install --force-reinstall mpi4py mpich"
        ) from None
    if report["stage"] == "mpi4py":
        raise LaunchError(
            f"mpi4py does not import in {python}: {report['error']}; "
            "fix: pip install mpi4py mpich (into the environment of that python)"
        )
    if report["stage"] == "MPI":
        raise LaunchError(
            f"mpi4py imports but its MPI library does not load in {python}: {report['error']}; "
            "fix: pip install mpich (an MPI library mpi4py finds), or load your cluster's MPI "
            "module and rebuild mpi4py against it: pip install --no-binary mpi4py --force-reinstall mpi4py"
        )
    return str(report["library"])


def check_mpi_match(library_version: str, launcher: str, flavor: Flavor | None) -> list[str]:
    """Fail unless mpi4py's MPI library (``library_version``) and the launcher's ``flavor`` belong
    to the same MPI; ranks started by a foreign mpiexec each come up as rank 0 of a 1-rank world.

    ``srun`` starts any MPI through PMI, so it always matches. An unknown launcher fails (its
    command-line syntax is unknown); an unknown library only warns. Returns warning lines.
    """
    first_line = library_version.strip().splitlines()[0] if library_version.strip() else "?"
    if flavor is None:
        raise LaunchError(
            f"cannot tell which MPI {launcher} belongs to from its --version output; "
            f"fix: pass --mpiexec PATH of the MPICH or Open MPI launcher that matches mpi4py's "
            f"MPI ({first_line})"
        )
    if flavor == "srun":
        return []
    library = flavor_from_version(library_version)
    if library is None:
        return [f"cannot tell which MPI mpi4py uses ({first_line}); assuming it matches {launcher}"]
    if library == flavor:
        return []
    if library == "mpich":
        fix = (
            "pip install mpich (puts a matching mpiexec into this environment, which "
            f"{PROG} tries first), or pass --mpiexec PATH of an MPICH mpiexec"
        )
    else:
        fix = "pass --mpiexec PATH of Open MPI's mpirun (the one that belongs to mpi4py's libmpi)"
    raise LaunchError(
        f"MPI mismatch: mpi4py uses {FLAVOR_NAMES[library]} ({first_line}), but the mpiexec found, "
        f"{launcher}, is {FLAVOR_NAMES[flavor]}; ranks would not see each other; fix: {fix}"
    )


# --------------------------------------------------------------------------------------------
# Running: signal forwarding and escalation
# --------------------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (guards against killing a recycled pid), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the last ')' are fixed.
    return stat.rsplit(")", 1)[1].split()[19]


def _descendants(root: int) -> list[tuple[int, str]]:
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
        self._tracked: dict[int, str] = {}
        self._timer: threading.Timer | None = None
        # Re-entrant: a third Ctrl-C can interrupt the main thread inside kill().
        self._lock = threading.RLock()

    def _track(self) -> None:
        # Snapshot now: once the launcher dies its ranks are re-parented and can't be found.
        self._tracked.update(_descendants(self.proc.pid))

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
    128 + the received signal even if the launcher exited 0.
    """
    # A new session keeps a terminal's Ctrl-C from reaching the job directly: we forward it
    # once, in order, and own the escalation.
    proc = subprocess.Popen(list(cmd), start_new_session=True, env=None if env is None else dict(env))
    stopper = _Stopper(proc, grace_s, sigint_as)
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, stopper.on_signal)
    try:
        returncode = proc.wait()
    finally:
        # Handlers first, so that no new forwarding starts while finish() sweeps.
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # type: ignore[arg-type]
        stopper.finish()
    if stopper.signum is not None:
        return 128 + stopper.signum
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _arg_positive_int(text: str) -> int:
    try:
        return _positive_int(text, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1") from None


def _arg_hosts(text: str) -> tuple[str, ...]:
    try:
        return tuple(str(parse_host(h)) for h in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; example: --hosts node1,node2 or node1:4,node2:4") from None


def _arg_env(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not _ENV_KEY.match(key):
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE with KEY a variable name; example: --env OMP_NUM_THREADS=4")
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
            "  lightning-mpi -n 8 --hostfile hosts.txt --dry-run train.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "-np", "--np", dest="nprocs", metavar="N", type=_arg_positive_int,
                        required=True, help="number of ranks (>= 1)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="a,b", type=_arg_hosts,
                       help="comma-separated hosts, each 'name' or 'name:slots'")
    where.add_argument("--hostfile", metavar="F",
                       help="hostfile: 'host', 'host:slots' (MPICH) or 'host slots=K' (Open MPI) lines")
    parser.add_argument("--ppn", metavar="K", type=_arg_positive_int, help="ranks per node")
    parser.add_argument("--mpiexec", metavar="PATH",
                        help="launcher to use (default: the venv's mpiexec, then PATH; srun under Slurm)")
    parser.add_argument("--env", metavar="K=V", type=_arg_env, action="append", default=[],
                        help="export K=V to every rank (repeatable)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the checks, print the command, do not launch")
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
    hostfile = read_hostfile(args.hostfile) if args.hostfile else None
    entries = list(hostfile.entries) if hostfile else [parse_host(h) for h in (args.hosts or ())]
    if entries:
        check_hosts_resolve([e.name for e in entries])
    launcher, flavor = _choose_launcher(args.mpiexec, environ)
    library = check_mpi4py(sys.executable)
    notes += check_mpi_match(library, launcher, flavor)
    assert flavor is not None  # check_mpi_match raised otherwise

    hosts = tuple(args.hosts or ())
    hostfile_path = args.hostfile
    if hostfile is not None and (flavor == "srun" or hostfile.syntax not in ("plain", flavor)):
        # srun has no hostfile option of this form, and hydra / Open MPI each reject the other's
        # slot syntax: hand the parsed hosts over on the command line, which both understand.
        hosts, hostfile_path = tuple(str(e) for e in entries), None
        notes.append(f"hostfile {args.hostfile!r} passed as a host list for {FLAVOR_NAMES[flavor]}")
    try:
        spec = LaunchSpec(
            nprocs=args.nprocs,
            script=args.script,
            script_args=tuple(args.script_args),
            hosts=hosts,
            hostfile=hostfile_path,
            ppn=args.ppn,
            env=tuple(args.env),
            launcher=launcher,
        )
        command = build_command(spec, flavor)
    except ValueError as exc:
        raise LaunchError(f"{exc}") from None

    header = f"{args.nprocs} rank{'s' if args.nprocs != 1 else ''} via {FLAVOR_NAMES[flavor]} ({launcher})"
    if flavor == "srun" and not (entries and args.ppn):
        where = ",".join(e.name for e in entries) or environ.get("SLURM_JOB_NODELIST", "the allocation")
        per_node = f", at most {args.ppn} per node" if args.ppn else ""
        topology = [header, f"Slurm places them on {where}{per_node}"]
    else:
        topology = [header, *format_topology(plan_topology(args.nprocs, entries, args.ppn))]
    return _Plan(spec, flavor, command, topology, notes)


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
    print(f"{PROG}: command: {shlex.join(plan.command)}", file=sys.stderr, flush=True)
    sigint_as = signal.SIGTERM if plan.flavor == "srun" else signal.SIGINT
    try:
        return run_command(plan.command, sigint_as=sigint_as)
    except OSError as exc:  # the launcher vanished or is not executable after the checks
        return _error(parser, f"cannot start {plan.command[0]}: {exc}")
