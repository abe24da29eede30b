"""The ``lightning-mpi`` launcher (see :mod:`lightning_mpi.launcher.cli`)."""
from .cli import *  # noqa: F401,F403
from .cli import __all__  # noqa: F401
