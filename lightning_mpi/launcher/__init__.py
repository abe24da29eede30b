"""The ``lightning-mpi`` launcher: an ``mpiexec`` front end with sanity checks.

Modules: :mod:`.cli` (checks in order, ``main``), :mod:`.arguments` (the argument parser),
:mod:`.hosts` (host lists and hostfiles), :mod:`.command` (the pure command builder),
:mod:`.plan` (the launch plan and the lines printed about it), :mod:`.topology` (rank
placement), :mod:`.checks` (launcher and mpi4py checks), :mod:`.process` (running the job,
stopping it), :mod:`.relaunch` (running it, and relaunching a failed job), :mod:`.restarts` (the
restart policy: the hosts and ranks left).
Standard library only: it runs before the ranks start.
"""

from .cli import main

__all__ = ["main"]
