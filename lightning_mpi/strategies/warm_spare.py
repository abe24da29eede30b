"""``spares=1`` with ``heal="replace"``: the run keeps a warm spare ready, so that a lost rank is
replaced at the next batch instead of after a new interpreter's start-up.

Without a spare, the survivors spawn a replacement after the loss and train on at the smaller
world size until it has imported torch, Lightning and the script (5-15 s here; far longer with
data loader workers or ``torch.compile``). With one, the ranks have spawned that process ahead
(:func:`~lightning_mpi.comm.spare.spawn_spare`, at the first training batch and again after each
let-in; collective, about a second); it imported everything, built its strategy and waits, idle.
After a heal the survivors let it in at the first batch the rule allows
(:func:`~lightning_mpi.comm.spare.let_in`), and it takes the handover as any replacement does
(:mod:`.replacement`).

What it costs: one more process per job, idle but holding its memory (the script's imports and
whatever the script builds before its ``Trainer``), its start-up's CPU, the spawn (about a second
of every rank's time, each time a spare is spawned), and one more slot: give the hosts a spare
slot or let the launcher oversubscribe, else no spare starts (rank 0 says so once) and replacement
falls back to spawning after the loss. A spare talks to the run's rank 0 of its spawn only: if
that rank is lost, its spare is given up and the lost ranks are spawned after the loss, as
without spares.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

from lightning_mpi.comm.respawn import JOIN_TIMEOUT, Respawned
from lightning_mpi.comm.spare import Spare, let_in, spawn_spare
from lightning_mpi.comm.ulfm import ProcessFailed

__all__ = ["NONE", "READY", "STARTING", "WarmSpare"]

#: The spare's verdicts, rank 0's, broadcast to every survivor.
READY, STARTING, NONE = 1, 0, -1


class WarmSpare:
    """The run's warm spare, the same on every rank (each holds its handle on the spare world;
    the spare's leader, rank 0 at the spawn, is the one that talks to it).

    Every method is called on every rank at the same point (the state changes only through
    collective steps or rank 0's broadcast verdicts), so that every rank agrees on whether there
    is a spare.

    Args:
        count: spares to keep (0: none, this object does nothing; 1).
        script, argv: what a spare runs (the script as launched).
    """

    def __init__(self, count: int, script: str, argv: list[str]) -> None:
        self.count = count
        self.script = script
        self.argv = argv
        self._spare: Spare | None = None
        self._gave_up = False  # no spare could be started: no more tries (rank 0 said so once)
        self.spawned = 0  # spares spawned, for the record

    @property
    def wanted(self) -> bool:
        """Spares were asked for (the same on every rank)."""
        return self.count > 0

    @property
    def held(self) -> bool:
        """A spare is held (spawned and not given up)."""
        return self._spare is not None

    def keep_ready(self, base: Any, rank: int) -> None:
        """At a batch with nothing to replace, on every rank: spawn a spare over ``base`` when there
        is none (collective, about a second). Raises :class:`ProcessFailed` for a rank lost
        meanwhile (heal; the spawn is tried again at a later batch)."""
        if not self.wanted or self._gave_up or self._spare is not None:
            return
        if not self.script or not os.path.isfile(self.script):
            self._give_up(rank, f"no warm spare: {sys.argv[0]!r} is no script to spawn")
            return
        spare = spawn_spare(base, self.script, self.argv)
        if spare is None:
            self._give_up(
                rank,
                "no warm spare could be started (no free slot for one more process?): give a host a spare slot or "
                "launch with --oversubscribe; lost ranks are replaced by processes spawned after the loss",
            )
            return
        self._spare = spare
        self.spawned += 1

    def verdict(self, rank: int) -> int:
        """On rank 0 (broadcast it, then :meth:`drop` on :data:`NONE`): :data:`READY`, :data:`STARTING`
        (alive, still importing), or :data:`NONE` (no spare, it died, its leader was lost, or it did
        not start in ``JOIN_TIMEOUT`` seconds)."""
        spare = self._spare
        if rank != 0 or spare is None or spare.closed or not spare.leader:
            return NONE
        try:
            if spare.ready():
                return READY
        except ProcessFailed:
            return NONE
        if time.perf_counter() - spare.spawned_at > JOIN_TIMEOUT:
            return NONE
        return STARTING

    def drop(self) -> None:
        """Give the spare up (after a :data:`NONE` verdict, on every rank): its leader tells it to
        exit, every rank frees its handle."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.dismiss()

    def let_in(self, base: Any) -> Respawned | None:
        """Collective over the survivors' ``base``: the spare merged after them, or ``None`` (on
        every survivor) when it did not come. Raises :class:`ProcessFailed` for a survivor lost
        meanwhile; the spare is given up either way."""
        spare, self._spare = self._spare, None
        try:
            return let_in(base, spare)
        finally:
            if spare is not None:
                spare.close()

    def close(self) -> None:
        """The run ended (or this rank leaves it): the spare is told to exit."""
        self.drop()

    def _give_up(self, rank: int, message: str) -> None:
        self._gave_up = True
        if rank == 0:
            warnings.warn(f"lightning_mpi: {message}", RuntimeWarning, stacklevel=4)
