"""``spares=1`` with ``heal="replace"``: rank 0 keeps a warm spare ready, so that a lost rank is
replaced at the next batch instead of after a new interpreter's start-up.

Without a spare, the survivors spawn a replacement after the loss and train on at the smaller
world size until it has imported torch, Lightning and the script (5-15 s here; far longer with
data loader workers or ``torch.compile``). With one, rank 0 has spawned that process ahead
(:func:`~lightning_mpi.comm.spare.spawn_spare`, at the first training batch and again after each
let-in); it imported everything, built its strategy and waits, idle. After a heal the survivors
let it in at the first batch the rule allows (:func:`~lightning_mpi.comm.spare.let_in`), and it
takes the handover as any replacement does (:mod:`.replacement`).

What it costs: one more process per job, idle but holding its memory (the script's imports and
whatever the script builds before its ``Trainer``), and one more slot: give the hosts a spare slot
or let the launcher oversubscribe, else no spare starts (rank 0 says so once) and replacement
falls back to spawning after the loss. A spare is rank 0's: if rank 0 itself is lost, its spare
exits and the healed run's new rank 0 spawns another (the lost rank is then replaced by a new
spawn, as without spares).
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

__all__ = ["WarmSpare"]

#: The spare's verdicts, rank 0's, broadcast to every survivor.
READY, STARTING, NONE = 1, 0, -1


class WarmSpare:
    """Rank 0's warm spare (inert on other ranks but for the collective :meth:`let_in`).

    Args:
        count: spares to keep (0: none, this object does nothing; 1).
        script, argv: what a spare runs (the script as launched).
    """

    #: batches between rank 0's looks at whether its spare is still there (local, an ``Iprobe``)
    check_every = 32

    def __init__(self, count: int, script: str, argv: list[str]) -> None:
        self.count = count
        self.script = script
        self.argv = argv
        self._spare: Spare | None = None
        self._batches = 0
        self._gave_up = False  # rank 0 could not start a spare: no more tries (said once)
        self.spawned = 0  # spares spawned on this rank (rank 0), for the record

    @property
    def wanted(self) -> bool:
        """Spares were asked for (the same on every rank: decides who takes part in a verdict)."""
        return self.count > 0

    def keep_ready(self, rank: int) -> None:
        """At a batch with nothing to replace, on every rank (only rank 0 acts, and nothing here is
        collective): spawn a spare when there is none, and drop one that died."""
        if not self.wanted or rank != 0 or self._gave_up:
            return
        self._batches += 1
        if self._spare is not None and self._batches % self.check_every == 0:
            try:
                self._spare.ready()
            except ProcessFailed:
                self._spare = None  # it died while waiting: spawn another at the next batch
        if self._spare is None or self._spare.closed:
            self._spawn()

    def verdict(self, rank: int) -> int:
        """On rank 0 (broadcast it): :data:`READY`, :data:`STARTING` (alive, still importing), or
        :data:`NONE` (no spare, it died, or it did not start in ``JOIN_TIMEOUT`` seconds)."""
        spare = self._spare
        if rank != 0 or spare is None or spare.closed:
            return NONE
        try:
            if spare.ready():
                return READY
        except ProcessFailed:
            self._spare = None
            return NONE
        if time.perf_counter() - spare.spawned_at > JOIN_TIMEOUT:
            spare.dismiss()
            self._spare = None
            return NONE
        return STARTING

    def let_in(self, base: Any, rank: int) -> Respawned | None:
        """Collective over the survivors' ``base``: the spare merged after them, or ``None`` (on
        every survivor) when it did not come. Raises :class:`ProcessFailed` for a survivor lost
        meanwhile; the spare is given up either way."""
        spare, self._spare = (self._spare, None) if rank == 0 else (None, None)
        try:
            return let_in(base, spare)
        finally:
            if spare is not None:
                spare.close()

    def close(self) -> None:
        """The run ended (or this rank leaves it): rank 0 tells its spare to exit."""
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.dismiss()

    def _spawn(self) -> None:
        if not self.script or not os.path.isfile(self.script):
            self._give_up(f"no warm spare: {sys.argv[0]!r} is no script to spawn")
            return
        spare = spawn_spare(self.script, self.argv)
        if spare is None:
            self._give_up(
                "no warm spare could be started (no free slot for one more process?): give a host a spare slot or "
                "launch with --oversubscribe; lost ranks are replaced by processes spawned after the loss"
            )
            return
        self._spare = spare
        self.spawned += 1

    def _give_up(self, message: str) -> None:
        self._gave_up = True
        warnings.warn(f"lightning_mpi: {message}", RuntimeWarning, stacklevel=4)
