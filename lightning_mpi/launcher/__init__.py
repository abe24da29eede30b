"""The ``lightning-mpi`` launcher: an ``mpiexec`` front end with sanity checks.

Modules: :mod:`.cli` (arguments, checks in order, ``main``), :mod:`.hosts` (host lists and
hostfiles), :mod:`.command` (the pure command builder), :mod:`.topology` (rank placement),
:mod:`.checks` (launcher and mpi4py checks), :mod:`.process` (running the job, stopping it),
:mod:`.restarts` (relaunching a failed job, on the hosts left).
Standard library only: it runs before the ranks start.
"""

from .cli import main

__all__ = ["main"]
