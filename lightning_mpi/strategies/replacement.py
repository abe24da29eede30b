"""``heal="replace"``: after a heal, the survivors spawn new processes back up to the world size the
strategy started with, and each new process joins the run in step.

The survivors, at the start of training batches (:meth:`RunReplacing.at_batch_start`, where every
survivor is, after the interrupted step was finished on the healed run: the Trainer's batch start,
or ``fabric.strategy.let_in(state)`` at the top of a Fabric loop's iteration):

1. at the first batch after a heal: :class:`~lightning_mpi.comm.healing.Growing` spawns
   ``python -m lightning_mpi.comm.spawned <script> <arguments>`` (``sys.argv`` as launched) once
   per lost rank, in a thread of its own. The new processes start MPI and join (a second or more
   on a loaded machine); a new process that dies before it joined makes the spawn be tried once
   more (:func:`~lightning_mpi.comm.respawn.respawn`), then the survivors go on without
   replacements; a survivor that dies is healed as any loss, and the spawn is given up and started
   again for the healed run. At the first batch after the spawn began and every
   :attr:`RunReplacing.poll_every` batches after it, the survivors look whether the thread has
   ended on every one of them (a small collective). **The survivors train on** meanwhile, and
   while the new processes import and build their Trainer; training that ends first gives the
   spawn up (:meth:`RunReplacing.end`);
2. at the batch where the spawn was found ended and every :attr:`RunReplacing.poll_every` batches
   after it, rank 0 looks whether every new process said it is ready (its strategy is built) and the
   survivors take its verdict (a small broadcast). A new process that died, or is not ready
   within ``JOIN_TIMEOUT`` seconds, is given up and spawned again;
3. once they are ready, at the first batch where the rule has no exchange in flight (Streaming
   DiLoCo's ``overlap_steps``: a new rank could not take part in it): read what the rule keeps
   (:meth:`~lightning_mpi.rules.base.BoundRule.heal_state`) and close it, gather which data shard each survivor trains
   on this epoch, make the run's communicators over
   survivors + new ranks (:func:`~lightning_mpi.comm.healing.finish_growth`; the survivors keep
   their ranks, the new ones come after), adopt them (ranks, world size, node layout) and broadcast
   rank 0's *handover*: Lightning's own checkpoint dictionary of this moment (``dump_checkpoint``:
   weights, optimizer and scheduler states, the loops' progress, the callbacks' states; under
   Fabric the loop's state dictionary as ``fabric.save`` converts it, and the bound module's
   weights: :class:`LoopAccess`) with the rule's kept state in it, and each new rank's shard;
4. bind the rule again with its state, restart the preemption vote, and shard the loaders anew
   from the next epoch, as after a heal. Rank 0 prints one line per replacement.

A new process runs the user's script from the top. Its strategy finds in ``__init__`` that it
was spawned (:func:`~lightning_mpi.comm.healing.join_run`), says it is ready and waits to be let
in: ranks and world size are the grown run's from the start. Its ``fit`` resumes from the
handover as from a checkpoint saved in the middle of an epoch (the launcher passes
``ckpt_path=HANDOVER_PATH``, which the strategy's ``load_checkpoint`` answers with the handover;
a ``ckpt_path`` of the script is ignored). Until its first training batch, where it reaches the
survivors, Lightning's collectives stay local on it (a barrier returns, a broadcast or reduction
returns this rank's value: the survivors are past them); the survivors' collectives of steps 3-4
it makes at the same points of its own start-up: the handover in the launcher, the rule's binding
in ``setup``, the rule's ``on_train_start`` and the vote in ``on_train_start``.

Under Fabric a new process takes the handover in the strategy's ``__init__``, right after it was
let in; ``fabric.setup`` gives its module rank 0's weights (no collective) and binds the rule
with the handed state (the survivors bind again at the same point), its collectives return at once
until its first ``let_in(state)``, which fills ``state`` in place as ``fabric.load`` would: the
loop goes on from the counters in it. The loaders are the user's: a loop that picks its batches
by ``fabric.global_rank`` and ``fabric.world_size`` follows the grown run at once.

Data in the epoch the replacement joins (the Trainer): it takes the shard of a rank lost this epoch (the same
sampler, seed and epoch as that rank had: the same samples) and skips the batches of it that the
epoch went through; the batches that rank missed between its loss and the join are not seen this
epoch. With more replacements than shards lost this epoch (a heal at an epoch's end, the next
epoch already sharded over the survivors), the extra ones repeat a survivor's shard for the rest
of that epoch. From the next epoch every loader is sharded over the restored world size.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_mpi.comm.errors import ProcessFailed, process_failure
from lightning_mpi.comm.healing import Growing, HealedRun, finish_growth, join_run, poll_ready
from lightning_mpi.comm.respawn import JOIN_TIMEOUT, Respawned, placement
from lightning_mpi.comm.spares import call_spares, is_spare, spares_left
from lightning_mpi.comm.ulfm import free as ulfm_free
from lightning_mpi.comm.ulfm import revoke as ulfm_revoke
from lightning_mpi.strategies.healing import RunHealing, remember_healed

__all__ = ["HANDOVER_PATH", "REPLACEMENT_REASON", "Handover", "LoopAccess", "RunReplacing", "replacement_shards"]

#: The ``ckpt_path`` a replacement's ``fit`` resumes from: the survivors' handover, not a file.
HANDOVER_PATH = "lightning_mpi:handover"
#: Why a replacement's ``fit`` resumes (the launcher's reason).
REPLACEMENT_REASON = "replacement"


@dataclass(frozen=True)
class LoopAccess:
    """How :class:`RunReplacing` reads the frontend's training loop where new ranks are let in
    (``at``: the Trainer, or the state dictionary of a Fabric loop):

    - ``snapshot(at)``: on rank 0, the checkpoint dictionary handed over (the rule's kept state is
      added under the strategy's key);
    - ``step(at)``: the step reached (for the line rank 0 prints);
    - ``batches_done(at)``: the batches of this epoch already trained (a new rank skips them in its
      shard; 0 where the strategy does not shard the loaders).
    """

    snapshot: Callable[[Any], dict[str, Any]]
    step: Callable[[Any], int]
    batches_done: Callable[[Any], int]


@dataclass
class Handover:
    """What rank 0 sends the new ranks after a respawn.

    - ``checkpoint``: Lightning's checkpoint dictionary at the start of the batch, the rule's
      kept state under the strategy's key (as in a checkpoint file);
    - ``shards``: per new rank, the ``(num_replicas, rank)`` of the training shard it takes this
      epoch (``None``: the survivors' loader is not sharded);
    - ``skip_batches``: the batches of this epoch already trained;
    - ``boundaries``: the survivors' count of training batches begun (this one included), which
      the new rank continues (:attr:`.healing.RunHealing.boundaries`);
    - ``start_size``: the world size the run started with (what ``min_ranks`` is a majority of, and
      what a replacement grows the run back to), not the new rank's first world size;
    - ``grow_pending``: ranks are still missing after this let-in (fewer spares than ranks lost):
      every rank, the new ones too, starts the spawn of the rest at the next batch (a collective).
    """

    checkpoint: dict[str, Any]
    shards: list[tuple[int, int] | None]
    skip_batches: int
    boundaries: int  # the survivors' count of batches begun, this one included
    start_size: int
    grow_pending: bool


def replacement_shards(taken: list[tuple[int, int] | None], missing: int) -> list[tuple[int, int] | None]:
    """The training shard, ``(num_replicas, rank)``, that each of ``missing`` new ranks takes for the
    rest of the epoch, given the survivors' (``taken``): the shards of ranks lost this epoch first,
    then survivors' shards again (every rank must run as many batches). ``None`` when the
    survivors' loaders are not sharded alike."""
    shards = [shard for shard in taken if shard is not None]
    if not taken or len(shards) < len(taken) or len({size for size, _ in shards}) != 1:
        return [None] * missing
    size, ranks = shards[0][0], [rank for _, rank in shards]
    lost = [r for r in range(size) if r not in ranks]
    return [(size, lost[j] if j < len(lost) else ranks[j % len(ranks)]) for j in range(missing)]


@dataclass
class _Spawning:
    """A spawn running in a thread of its own while the survivors train on."""

    growing: Growing
    started: float  # perf_counter at the spawn
    events: int  # the survivors' heals at the spawn: one more means a survivor was lost
    batches: int = 0  # batches since the spawn began (the same count on every survivor)


@dataclass
class _Pending:
    """Processes spawned and joined to the survivors, starting up (not yet in the run)."""

    respawned: Respawned
    started: float  # perf_counter at the spawn
    deadline: float  # monotonic: give them up after this
    events: int  # the survivors' heals at the spawn: one more means a survivor was lost
    heard: set[int] = field(default_factory=set)
    batches: int = 0  # batches since the spawn (the same count on every survivor)
    ready: bool = False  # every new process said it is ready; let in at the next batch the rule allows
    spares: bool = False  # spares launched with the job (ready at once), not processes spawned


class RunReplacing:
    """``heal="replace"`` for one strategy (module docstring); inert otherwise.

    Args:
        healing: the strategy's :class:`~.healing.RunHealing` (its mode, ``grow_pending``, stats).
        failures: the strategy's :class:`~.failures.RunFailures` (transport, ranks).
        environment: the strategy's MPI cluster environment.
        runner: the strategy's :class:`~.rule_runner.RuleRunner`.
        sharding: the strategy's :class:`~.sharding.LoaderSharding` (``None``: the loaders are the
            user's, as under Fabric).
        adopt: the strategy's ``adopt(state)`` after a heal (ranks, rule, vote, loaders).
        checkpoint_key: where the rule's state goes in a checkpoint dictionary.
        loop: how the frontend's loop is read at a let-in.
    """

    #: while new processes start, the survivors ask whether they are ready at the first batch after
    #: the spawn and then every this many batches (each asking is a small collective)
    poll_every = 8
    #: seconds :meth:`end` waits for a spawn in flight to stop
    END_WAIT = 10.0

    def __init__(
        self,
        healing: RunHealing,
        failures: Any,
        environment: Any,
        runner: Any,
        sharding: Any,
        adopt: Callable[[dict[str, Any] | None], None],
        checkpoint_key: str,
        loop: LoopAccess,
    ) -> None:
        self._healing = healing
        self._failures = failures
        self._environment = environment
        self._runner = runner
        self._sharding = sharding
        self._adopt = adopt
        self._key = checkpoint_key
        self._loop = loop
        # the script as launched, resolved now (the working directory may change later)
        self.script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else ""
        self.argv = list(sys.argv[1:])
        self.handover: Handover | None = None
        self._spawning: _Spawning | None = None  # a spawn in flight, in a thread of its own
        self._pending: _Pending | None = None  # spawned processes not yet let in
        #: a replacement before its first training batch: Lightning's collectives stay local
        self.catching_up = False

    @property
    def active(self) -> bool:
        return self._healing.mode == "replace"

    # -- in a replacement ------------------------------------------------------------------------------
    def join(self) -> None:
        """In the strategy's ``__init__``: a process the survivors spawned joins their run (its half
        of :func:`~lightning_mpi.comm.healing.grow_run` and of the survivors' adoption). A spare
        waits here until it is let in, whatever its own ``heal`` (the training ranks' decides), or
        leaves when the job ends."""
        if not self.active and not is_spare():
            return
        run = join_run(self._failures.timeout, min_ranks=self._healing.requested_min_ranks)
        if run is None:
            return
        self._failures.adopt(run)
        self._environment.device_local_rank = None  # a new process: its device follows its local rank
        self._environment.adopt(run.base)
        self._environment.device_local_rank = self._environment.local_rank()
        remember_healed(run.base)
        self._healing.start_size = run.transport.size
        self.catching_up = True

    def resume_reason(self) -> str | None:
        """The launcher's reason to resume the next ``fit`` whatever its ``ckpt_path``: a replacement
        that has not received the handover yet."""
        return REPLACEMENT_REASON if self.catching_up and self.handover is None else None

    def receive(self) -> str:
        """In a replacement's launcher: the survivors' handover (collective); returns the
        ``ckpt_path`` to resume from."""
        transport = self._failures.transport
        handover: Handover = transport.broadcast_object(None, root=0)
        healing = self._healing
        healing.start_size = handover.start_size  # before after_let_in: min_ranks is a majority of it
        healing.grow_pending, healing.grow_at = handover.grow_pending, 0  # the survivors' next batch
        healing.after_let_in(transport)  # with the survivors (they do it after the same broadcast)
        self.handover = handover
        healing.boundaries = handover.boundaries - 1  # its first batch's start counts the join's
        shard = handover.shards[transport.rank - (transport.size - len(handover.shards))]
        if shard is not None and self._sharding is not None:
            self._sharding.next_training_shard = (*shard, handover.skip_batches)
        return HANDOVER_PATH

    def checkpoint(self, path: Any) -> dict[str, Any] | None:
        """The handover's checkpoint for ``path`` = :data:`HANDOVER_PATH`, else ``None``."""
        if self.handover is None or str(path) != HANDOVER_PATH:
            return None
        return self.handover.checkpoint

    # -- at every training batch ---------------------------------------------------------------------
    def at_batch_start(self, at: Any) -> None:
        """A replacement reached the survivors; survivors with ranks to replace spawn them, or let
        in those spawned that are ready. ``at``: the Trainer, or a Fabric loop's state."""
        self._healing.boundaries += 1
        if self.catching_up:
            self.catching_up = False
            if self._sharding is not None:
                self._sharding.reshard_next_epoch(at)  # as the survivors: every rank anew next epoch
            return
        if not self.active:
            return
        spawning = self._spawning
        if spawning is not None and spawning.events != self._healing.events:
            self.end()  # a survivor was lost meanwhile: spawn anew for the healed run
            spawning = None
        if spawning is not None:
            spawning.batches += 1
            if self._asks(spawning.batches):
                self._spawned(at, spawning)
            return
        pending = self._pending
        if pending is not None and pending.events != self._healing.events:
            self._give_up(revoke=True)  # a survivor was lost meanwhile: spawn anew for the healed run
            pending = None
        if pending is not None:
            pending.batches += 1
            if pending.ready:
                self._let_in(at, pending)
            elif self._asks(pending.batches):
                self._poll(at, pending)
        elif self._healing.grow_pending and self._healing.boundaries >= self._healing.grow_at:
            self._start()
            if self._pending is not None and self._pending.ready:  # spares: in at once
                self._let_in(at, self._pending)

    def _asks(self, batches: int) -> bool:
        """Whether the survivors ask (a small collective) at the ``batches``-th batch since a spawn
        began, or since its processes joined: the first, then every :attr:`poll_every`."""
        return batches % self.poll_every == 1 or self.poll_every == 1

    def _start(self) -> None:
        """Let spares in (:mod:`~lightning_mpi.comm.spares`: ready at once) or start spawning the
        missing ranks (:class:`~lightning_mpi.comm.healing.Growing`: a collective ``Dup``, then a
        thread of its own; training goes on meanwhile)."""
        healing, failures = self._healing, self._failures
        healing.grow_pending = False
        missing = healing.start_size - failures.world_size
        if missing <= 0:
            return
        started = time.perf_counter()
        if spares_left():  # spares launched with the job: in at once, no process to start
            called = healing.between("calling the spares", lambda: call_spares(failures.base_comm, missing), None)
            if called is None:  # a survivor died meanwhile: healed again; at the next batch
                return
            if called.new_ranks:
                self._pending = _Pending(called, started, time.monotonic(), healing.events, ready=True, spares=True)
                return
            ulfm_free(called.comm)  # every spare is gone: spawn instead
        if not self.script or not os.path.isfile(self.script):
            self._say(f"cannot replace the lost ranks: {sys.argv[0]!r} is no script to spawn", warn=True)
            return
        hosts = self._hosts(missing)
        growing = healing.between(
            "the respawn", lambda: Growing(failures.base_comm, self.script, self.argv, missing, hosts=hosts), None
        )
        if growing is not None:  # else a survivor died meanwhile: healed again; spawn at the next batch
            self._spawning = _Spawning(growing, started, healing.events)

    def _hosts(self, missing: int) -> list[str] | None:
        """Where to start the new processes (:func:`~lightning_mpi.comm.respawn.placement`), when the
        survivors run on more than one host (on one, there is nothing to choose)."""
        processes = self._healing.processes
        hosts = [] if processes is None else [host for host, _ in processes.where]
        return placement(hosts, missing) if len(set(hosts)) > 1 else None

    def _spawned(self, at: Any, spawning: _Spawning) -> None:
        """Whether the spawn has ended on every survivor (a small collective); then its outcome: the
        new processes, joined, start up (:class:`_Pending`; asked at once whether they are ready), or
        none joined."""
        failures = self._failures
        everywhere = self._healing.between(
            "waiting for a spawn", lambda: all(failures.transport.allgather_object(spawning.growing.done())), None
        )
        if not everywhere:  # still spawning somewhere, or a survivor died (healed: given up at the next batch)
            return
        self._spawning = None
        try:
            spawned = spawning.growing.outcome()
        except ProcessFailed as failure:
            if failure.ranks or not failure.where.startswith("respawn (every"):
                self._healing.grow_pending = True  # a survivor died in the spawn: healed at the next operation
                return
            self._say(
                f"no replacement joined (every spawn lost a new process); training goes on at world size "
                f"{failures.world_size}",
                warn=True,
            )
            return
        deadline = time.monotonic() + JOIN_TIMEOUT
        pending = self._pending = _Pending(spawned, spawning.started, deadline, spawning.events, batches=1)
        self._poll(at, pending)  # ready already (spawned long enough ago)? let in at this batch

    def end(self) -> None:
        """Training ended (or a survivor was lost): give a spawn still in flight up, on every survivor."""
        spawning, self._spawning = self._spawning, None
        if spawning is not None and not spawning.growing.cancel(self.END_WAIT):
            self._say(f"a spawn in flight did not stop within {self.END_WAIT:g} s; leaving it", warn=True)

    def _poll(self, at: Any, pending: _Pending) -> None:
        """Rank 0 looks whether every new process is ready (its strategy built), and every survivor
        takes its verdict (a small broadcast, every ``poll_every`` batches while they start)."""
        failures = self._failures

        def verdict() -> int:
            mine = 0
            if failures.rank == 0:
                try:
                    mine = 1 if poll_ready(pending.respawned, pending.heard) else 0
                except Exception as error:  # noqa: BLE001  (a new process died: give this spawn up)
                    if process_failure(error) is None:
                        raise
                    mine = -1
                if mine == 0 and time.monotonic() > pending.deadline:
                    mine = -1
            return int(failures.transport.broadcast_object(mine, root=0))

        decided = self._healing.between("waiting for a replacement", verdict, None)
        if decided is None:  # a survivor died: healed; the spawn is given up at the next batch
            return
        if decided < 0:
            self._give_up(revoke=True)
            self._say("a replacement died or did not start in time; spawning again", warn=True)
            self._healing.grow_pending = True
            return
        if decided > 0:
            pending.ready = True
            self._let_in(at, pending)

    def _let_in(self, at: Any, pending: _Pending) -> None:
        """Let the ready new processes in, unless the rule has an exchange in flight (Streaming
        DiLoCo's ``overlap_steps``): a new rank could not take part in an exchange started without
        it, so it is let in at the next batch without one (the same batch on every survivor: they
        run the same schedule). Nothing is collective here before the switch."""
        bound = self._runner.bound if self._runner.live else None
        if bound is not None and bound.exchange_in_flight:
            return
        self._pending = None
        self._switch(at, pending)

    def _give_up(self, revoke: bool) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            if revoke:
                ulfm_revoke(pending.respawned.comm)  # the new process waiting to be let in stops
            ulfm_free(pending.respawned.comm)

    def _switch(self, at: Any, pending: _Pending) -> None:
        """Every new process is ready: the run grows over them, they take rank 0's handover."""
        healing, failures = self._healing, self._failures
        missing = len(pending.respawned.new_ranks)
        bound = self._runner.bound if self._runner.live else None
        state = None if bound is None else bound.heal_state()
        shards = self._shards(missing)
        self._runner.close()
        run = HealedRun(failures.base_comm, failures.errors, failures.transport)
        grown = finish_growth(run, pending.respawned)
        failures.adopt(grown)
        self._environment.adopt(grown.base)
        remember_healed(grown.base)
        transport = grown.transport
        # fewer spares than ranks lost: every rank, the new ones too, spawns the rest at the next batch
        healing.grow_pending = healing.mode == "replace" and transport.size < healing.start_size
        handover = None
        if transport.rank == 0:
            checkpoint = self._loop.snapshot(at)
            if state is not None and bound is not None:
                # rank 0 keeps its own part (residuals) and shares what it shares (GoSGD's weight)
                state, handed = bound.hand_over(state, missing)
                rule = type(self._runner.rule).__name__
                checkpoint[self._key] = {"rule": rule, "state": handed, "world_size": transport.size}
            handover = Handover(
                checkpoint,
                shards,
                self._loop.batches_done(at),
                healing.boundaries,
                healing.start_size,
                healing.grow_pending,
            )
        transport.broadcast_object(handover, root=0)
        healing.after_let_in(transport)  # with the new ranks (they do it after the same broadcast)
        self._adopt(state)
        joined = list(pending.respawned.new_ranks)
        seconds = time.perf_counter() - pending.started
        healing.replaced += len(joined)
        healing.history.append(
            {
                "joined": joined,
                "seconds": seconds,
                "world_size": transport.size,
                "attempts": pending.respawned.attempts,
                "spares": pending.spares,
            }
        )
        source = (
            f"{seconds:.2f} s after they were called (spares launched with the job)"
            if pending.spares
            else f"{seconds:.2f} s after the spawn (training went on meanwhile)"
        )
        self._say(
            f"replaced: {len(joined)} new rank{'s' if len(joined) > 1 else ''} ({', '.join(map(str, joined))}) "
            f"joined at step {self._loop.step(at)}, {source}; training goes on at world size {transport.size}"
        )

    def _shards(self, missing: int) -> list[tuple[int, int] | None]:
        """Per new rank, the training shard it takes this epoch (collective over the survivors;
        ``None`` each, without one, where the loaders are the user's)."""
        if self._sharding is None:
            return [None] * missing
        return replacement_shards(self._failures.transport.allgather_object(self._sharding.train_shard), missing)

    def _say(self, message: str, warn: bool = False) -> None:
        if self._failures.rank != 0:
            return
        if warn:
            warnings.warn(f"lightning_mpi: {message}", RuntimeWarning, stacklevel=3)
        else:
            sys.stderr.write(f"lightning_mpi: {message}\n")
            sys.stderr.flush()
