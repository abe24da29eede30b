"""What a failed sanity check raises, and the program name its messages go out under."""

from __future__ import annotations

__all__ = ["LaunchError", "PROG"]

PROG = "lightning-mpi"


class LaunchError(Exception):
    """A sanity check failed. The message names the bad argument or value and says how to fix it."""
