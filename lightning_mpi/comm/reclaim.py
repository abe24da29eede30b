"""Releasing what failed runs left, on the next run's fresh communicator.

:mod:`~lightning_mpi.comm.resources` is the registry (what one run made, and whether it was
abandoned); this module sits above it and above the transport and mailbox it needs to settle and
free an abandoned run collectively.
"""

from __future__ import annotations

import warnings

from lightning_mpi.comm.resources import RunResources
from lightning_mpi.comm.transport import Transport


def reclaim(abandoned: list[RunResources], transport: Transport) -> list[RunResources]:
    """Release what failed runs left, collectively over ``transport`` (a fresh, healthy one);
    returns what could not be released safely (kept referenced).

    Every rank must call it with its own list of the same failed runs. The ranks first agree on
    that (serials and counts): a rank whose list differs would free windows the others do not,
    and a window's free waits for every rank, so on any difference nothing is freed. Otherwise
    every run's mailboxes are settled (:meth:`~lightning_mpi.comm.mailbox.Mailbox.settle`), then
    its windows and communicators are freed (:meth:`RunResources.free_abandoned`).
    """
    if not abandoned:
        return []
    mine = [run.counts() for run in abandoned]
    if any(theirs != mine for theirs in transport.agree(mine)):
        warnings.warn(
            "lightning_mpi: the ranks abandoned different failed runs, so their communicators and windows "
            "are kept instead of freed (a few MB at most).",
            RuntimeWarning,
            stacklevel=2,
        )
        return abandoned
    for run in abandoned:
        for box in run.mailboxes:
            box.settle(transport)
        run.free_abandoned()
    return []
