"""Live healing (``heal="shrink"``): when a rank dies, the survivors rebuild the run over
themselves and go on training, without a restart, and without losing or repeating a step.

Every strategy holds one :class:`RunHealing`. With ``heal=None`` it is inert: every call runs its
operation once and a dead rank raises ``RankFailedError`` as before. With ``heal="shrink"`` (Open
MPI with ULFM, ``lightning-mpi --heal``), the strategy runs every operation that involves the
other ranks through it:

- :meth:`RunHealing.__call__`: a rule's operation (:class:`~lightning_mpi.rules.base.Operation`:
  the rule's hooks hand the strategy their collectives in that shape), redone or taken after a heal;
- :meth:`RunHealing.operation`: a collective of the strategy's own whose interruption can be
  redone (Lightning's ``reduce``/``all_gather``/``broadcast``/``barrier``);
- :meth:`RunHealing.between`: a check between operations (the error channel, the preemption vote),
  where nothing is left to redo.

When one of them raises :class:`~lightning_mpi.comm.ulfm.ProcessFailed`, this rank heals, with
every other survivor, wherever each of them noticed:

1. the rule is asked what it keeps (:meth:`~lightning_mpi.rules.base.BoundRule.heal_state`); a rule
   that cannot heal raises ``RankFailedError`` saying so (every survivor alike: they run the same
   rule);
2. :func:`~lightning_mpi.comm.healing.heal_run`: revoke, shrink, agree, a new error channel and
   transport over the survivors, the failed run released (the rule is abandoned first);
3. with fewer survivors than ``min_ranks`` (by default more than half of the ranks the run started
   with, so that the two sides of a network partition never train apart): ``RankFailedError``, as
   without ``heal``, and nothing more is saved on this side; the survivors SIGKILL the lost ranks
   that run on their own host (a frozen process that wakes up must not train on:
   :mod:`lightning_mpi.comm.liveness`);
4. the strategy adopts the new communicator: ranks, world size, node layout (the cluster
   environment, so ``trainer.world_size`` and ``global_rank`` follow), the rule is bound again on
   the new transport with what it kept, the preemption vote restarts;
5. the survivors agree on where they are. Each counts the operations it completed; ULFM does not
   promise that a collective fails on every rank alike, so one survivor may have completed the
   interrupted operation that another did not. The one behind takes that operation's result from
   one that completed it (every operation keeps its last result), and the others redo the
   operation they were in. Survivors more than one operation apart cannot be reconciled:
   ``RankFailedError``.

Rank 0 prints one line per heal; :attr:`RunHealing.stats` are logged as ``mpi/heal/*``.

With ``heal="replace"`` a heal also sets :attr:`RunHealing.grow_pending`: the Trainer strategy
then spawns replacements at the start of the next training batch (:mod:`.replacement`).
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from lightning_mpi.comm.errors import ProcessFailed, RankFailedError, RunStopped, process_failure
from lightning_mpi.comm.healing import HealedRun, heal_run
from lightning_mpi.comm.liveness import Processes, heartbeat, quorum
from lightning_mpi.comm.spares import waiting_beacons
from lightning_mpi.comm.ulfm import HEAL_ATTEMPTS, majority, mark_finished, require_heal
from lightning_mpi.rules.base import BoundRule, Operation

_T = TypeVar("_T")

#: serial numbers of healed runs' resources (every survivor heals the same number of times)
_HEAL_SERIALS = itertools.count(1_000_000)


class HealNotSupported(RankFailedError):
    """A rank died under ``heal="shrink"``, but the rule in use cannot heal yet."""

    def __init__(self, rule: str, why: str, failure: ProcessFailed) -> None:
        super().__init__(failure.rank, str(failure))
        self.args = (
            f"lightning_mpi: a rank died ({failure}), and heal='shrink' is not supported for rule {rule!r} yet "
            f"({why}); the run fails as with heal=None (docs/faults.md lists the rules that heal; "
            "`lightning-mpi --max-restarts` relaunches)",
        )


def _stopped(rank: int, message: str) -> RankFailedError:
    """A ``RankFailedError`` that says why the survivors stopped instead of healing."""
    error = RankFailedError(rank, message)
    error.args = (f"lightning_mpi: {message}",)
    return error


class RunHealing:
    """Heals the run when a rank dies (module docstring); inert with ``mode=None``.

    Args:
        mode: ``None``, ``"shrink"`` or ``"replace"`` (the strategy's ``heal``); a heal checks at once
            that this MPI can heal (:func:`~lightning_mpi.comm.ulfm.require_heal` names the fix).
        min_ranks: fewer survivors than this raise ``RankFailedError`` (``None``: more than half of
            the world size the strategy started with).
        failures: the strategy's :class:`~.failures.RunFailures` (its transport, channel, ranks).
        environment: the strategy's MPI cluster environment (:class:`~.environment.MPIClusterMixin`).
        bound: returns the bound rule (or ``None``).
        adopt: called after a heal, collectively, with the kept rule state (``None``: no rule is
            live): the strategy rebinds its rule on the new transport, updates what Lightning
            reads, restarts its vote.
        abandon: drops the bound rule without a collective (``RuleRunner.abandon``).
        rule_name: the rule's name, for messages.
    """

    def __init__(
        self,
        mode: str | None,
        min_ranks: int | None,
        failures: Any,
        environment: Any,
        bound: Callable[[], BoundRule | None],
        adopt: Callable[[dict[str, Any] | None], None],
        abandon: Callable[[], None],
        rule_name: str,
    ) -> None:
        self.mode = mode
        self.require(mode)
        self._failures = failures
        self._environment = environment
        self._bound = bound
        self._adopt = adopt
        self._abandon = abandon
        self._rule_name = rule_name
        self.completed = 0  # operations completed on this rank
        self._last: Any = None  # the last one's result, for a survivor that missed it
        self.events = 0
        self.seconds = 0.0
        self.history: list[dict[str, Any]] = []
        #: the world size to grow back to (``heal="replace"``): the strategy's at construction
        self.start_size = int(getattr(failures, "world_size", 1))
        #: the strategy's ``min_ranks`` as given (``None``: the default, read by :attr:`min_ranks`)
        self.requested_min_ranks = min_ranks
        #: the survivors were too few (``min_ranks``: the minority of a partition): this side stopped,
        #: and saves nothing more (:meth:`refuse_saves`)
        self.stopped = False
        #: every rank's host and pid, to kill the ones a heal leaves behind (under ``heal``)
        self.processes: Processes | None = None
        if self.active:
            heartbeat()  # started when MPI was (comm.liveness); here for a process that imported it first
            self._locate(Processes.gather(failures.transport))
        #: a heal happened and replacements are still to be spawned (``heal="replace"``)
        self.grow_pending = False
        #: training batches begun on this rank (counted by ``heal="replace"`` at each batch's start,
        #: the same count on every rank at the same batch: a new rank takes the survivors')
        self.boundaries = 0
        #: the batch (a ``boundaries`` count) from which the replacements may be spawned: one past
        #: the furthest survivor's at the heal, so that a survivor that was a batch behind (it
        #: took the interrupted operation's result) does not start the spawn, a collective, while
        #: another is already in the next batch's first operation
        self.grow_at = 0
        #: ranks spawned that joined (``heal="replace"``)
        self.replaced = 0

    def after_let_in(self, transport: Any) -> None:
        """After ranks were let in (``heal="replace"``; collective over the grown run, survivors and new
        ranks, after the handover): every rank's host and pid again, and the count of operations
        starts over on every rank, so that a later heal compares counts of the same operations (a new
        rank counted from its start, the survivors from theirs)."""
        self.completed = 0
        if self.active:
            self._locate(Processes.gather(transport))

    def _locate(self, processes: Processes) -> None:
        """``processes`` are the run's ranks now: the ones a heal kills on its host, and the ones this
        process's quorum hears (:mod:`lightning_mpi.comm.quorum`), with the spares still waiting."""
        self.processes = processes
        found = quorum()
        if found is not None:
            found.watch(processes.beacons, waiting_beacons(), self.min_ranks)

    def refuse_saves(self, target: Any) -> None:
        """Raise ``RankFailedError`` when this side of the run stopped (:attr:`stopped`): a minority
        that saved would leave a checkpoint beside the majority's, of a run that did not go on."""
        if self.stopped:
            raise RunStopped(
                -1,
                f"not saving {target}: this side of the run stopped with fewer than min_ranks={self.min_ranks} ranks "
                "(the other side, if it holds the majority, went on and saves its own)",
            )

    @property
    def min_ranks(self) -> int:
        """Fewer survivors than this stop their side: the strategy's ``min_ranks``, by default more
        than half of :attr:`start_size` (a spare let in learns the run's start size then)."""
        return self.requested_min_ranks if self.requested_min_ranks is not None else majority(self.start_size)

    @staticmethod
    def require(mode: str | None) -> None:
        """With ``heal`` set: raise ``HealUnavailable`` (naming the fix) unless this MPI can heal."""
        if mode is not None:
            require_heal()

    @property
    def active(self) -> bool:
        return self.mode is not None

    def distributed(self, world_size: int) -> bool:
        """Whether Lightning is to treat the run as distributed: more than one rank, or under
        ``heal`` a run that started with more and shrank to one (a key logged with ``sync_dist``
        must keep its sync within an epoch, or Lightning refuses it; a sync over one rank is free)."""
        return world_size > 1 or (self.active and self.start_size > 1)

    @property
    def stats(self) -> dict[str, float]:
        """``mpi/heal/events`` (heals so far), ``mpi/heal/seconds`` (the last one's, from detection
        to training again) and ``mpi/heal/world_size``; empty without ``heal``."""
        if not self.active:
            return {}
        stats = {
            "mpi/heal/events": float(self.events),
            "mpi/heal/seconds": float(self.seconds),
            "mpi/heal/world_size": float(self._failures.world_size),
        }
        if self.mode == "replace":
            stats["mpi/heal/replaced"] = float(self.replaced)
        return stats

    # -- what the strategy runs through it ------------------------------------------------------------
    @property
    def bound(self) -> BoundRule:
        """The rule as bound now (a heal binds it anew): what its operations act on."""
        bound = self._bound()
        assert bound is not None, "a rule's operations run while the rule is bound"
        return bound

    def __call__(self, operation: Operation[_T]) -> _T:
        """Run one of the rule's operations on the rule as bound now: once without ``heal``; under
        ``heal``, redone after a heal (what an interrupted attempt changed put back first), or taken
        from a survivor that completed it, or, for a one-sided step, left as it is."""
        if not self.active:
            return operation.run(self.bound)
        if not operation.redo:
            self.between(operation.where, lambda: operation.run(self.bound), None)
            return cast(_T, None)
        started = operation.start(self.bound)
        return self.operation(
            operation.where,
            lambda: operation.run(self.bound),
            keep=lambda value: operation.result(self.bound, value),
            take=lambda sent: operation.take(self.bound, sent, started),
            before_redo=lambda: operation.put_back(self.bound, started),
            counted=lambda: operation.collective(self.bound, started),
        )

    def operation(
        self,
        where: str,
        run: Callable[[], _T],
        keep: Callable[[_T], Any] = lambda result: result,
        take: Callable[[Any], _T] = lambda kept: kept,
        before_redo: Callable[[], None] | None = None,
        counted: Callable[[], bool] = lambda: True,
    ) -> _T:
        """Run the collective ``run()``; after a heal, redo it, or take its result from a survivor
        that completed it. ``keep(result)`` is what such a survivor sends (picklable), ``take``
        turns it back into this rank's result; ``before_redo`` restores the inputs that an
        interrupted attempt may have changed. ``run`` must read the transport afresh each time.
        ``counted()`` (asked once it completed) says whether it involved the other ranks: a rule's
        hook that made no collective this step is no operation to reconcile."""
        if not self.active:
            return run()
        while True:
            try:
                result = run()
            except Exception as error:
                failure = process_failure(error)
                if failure is None:
                    raise
                missed = self._heal(failure, where, error)
                if missed is not _NOTHING:
                    result = take(missed)
                    self._done(result, keep)
                    return result
                if before_redo is not None:
                    before_redo()
                continue
            if counted():
                self._done(result, keep)
            return result

    def between(self, where: str, check: Callable[[], _T], otherwise: _T) -> _T:
        """Run ``check()`` (between operations: nothing to redo); after a heal, ``otherwise``."""
        if not self.active:
            return check()
        try:
            return check()
        except Exception as error:
            failure = process_failure(error)
            if failure is None:
                raise
            self._heal(failure, where, error)
            return otherwise

    def _done(self, result: Any, keep: Callable[[Any], Any]) -> None:
        self.completed += 1
        self._last = keep(result)

    # -- the heal --------------------------------------------------------------------------------------
    def _heal(self, failure: ProcessFailed, where: str, error: BaseException) -> Any:
        # A loss noticed during validation is healed inside Lightning's inference mode: what the
        # heal keeps and binds anew (DiLoCo's outer state, residuals, buckets) must stay tensors
        # that training can update in place afterwards.
        with torch.inference_mode(False):
            return self._heal_outside_inference(failure, where, error)

    def _heal_outside_inference(self, failure: ProcessFailed, where: str, error: BaseException) -> Any:
        detected = time.perf_counter()
        bound = self._bound()
        try:
            state = None if bound is None else bound.heal_state()
        except LookupError as why:
            raise HealNotSupported(self._rule_name, str(why), failure) from error
        old_size = self._failures.world_size
        for _ in range(HEAL_ATTEMPTS):
            try:
                return self._heal_once(failure, where, error, state, detected, old_size)
            except Exception as again:
                if isinstance(again, RankFailedError) and not isinstance(again, ProcessFailed):
                    raise  # the survivors stop (min_ranks, too far apart): no failure to heal
                failed = process_failure(again)
                if failed is None:
                    raise
                # one more rank died while the survivors healed: heal the healed run again
                failure, error = failed, again
        raise _stopped(-1, f"ranks kept dying while the survivors healed ({HEAL_ATTEMPTS} heals)") from error

    def _heal_once(
        self,
        failure: ProcessFailed,
        where: str,
        error: BaseException,
        state: dict[str, Any] | None,
        detected: float,
        old_size: int,
    ) -> Any:
        failures, environment = self._failures, self._environment
        old_rank = failures.rank
        run: HealedRun = heal_run(
            failures.transport,
            failures.base_comm,
            serial=next(_HEAL_SERIALS),
            also=environment.derived_comms(),
            before_release=self._abandon,
        )
        assert run.healed is not None
        if self.processes is not None:  # a lost rank that is alive (stopped, cut off) must not train on
            self.processes.kill_lost(run.healed.lost)
        # the end of a process that healed is marked (a stop below ends its run with an exception: an
        # uncaught one aborts before the mark, and marks the job failed instead)
        remember_healed(run.base)
        failures.adopt(run)
        environment.adopt(run.base)
        transport = run.transport
        if transport.size < self.min_ranks:
            self.stopped = True
            raise RunStopped(
                run.healed.lost[0] if run.healed.lost else -1,
                f"rank(s) {', '.join(map(str, run.healed.lost))} of {old_size} were lost and {transport.size} of the "
                f"{self.start_size} ranks the run started with remain here, fewer than min_ranks={self.min_ranks} "
                "(by default more than half, so that the two sides of a network partition never train apart): this "
                "side stops and saves nothing more (`lightning-mpi --max-restarts` relaunches the run)",
            ) from error
        # Where is everyone: the operations each completed, and where each noticed.
        mine = (self.completed, where, failure.error_class, old_rank, self.boundaries)
        everyone = transport.allgather_object(mine)
        if self.processes is not None:
            self._locate(self.processes.survivors([entry[3] for entry in everyone]))
        self.grow_at = max(entry[4] for entry in everyone) + 1
        counts = [entry[0] for entry in everyone]
        low, high = min(counts), max(counts)
        if high - low > 1:
            raise _stopped(
                -1,
                f"after a heal the survivors were {high - low} operations apart (completed {counts}); they cannot "
                "be brought back in step",
            ) from error
        missed: Any = _NOTHING
        if low < high:
            sent = transport.broadcast_object(self._last if self.completed == high else None, root=counts.index(high))
            if self.completed == low:
                missed = sent
        self._adopt(state)
        seconds = time.perf_counter() - detected
        self.events += 1
        self.seconds = seconds
        detectors = [e for e in everyone if e[2] == "MPI_ERR_PROC_FAILED"] or everyone
        event = {
            "lost": list(run.healed.lost),
            "where": detectors[0][1],
            "detected_by": detectors[0][3],
            "seconds": seconds,
            "world_size": transport.size,
            "old_world_size": old_size,
            "redo": missed is _NOTHING,
        }
        self.history.append(event)
        self.grow_pending = self.mode == "replace" and transport.size < self.start_size
        if transport.rank == 0:
            lost = ", ".join(map(str, run.healed.lost))
            sys.stderr.write(
                f"lightning_mpi: healed: rank{'s' if len(run.healed.lost) > 1 else ''} {lost} of {old_size} lost "
                f"(detected in {event['where']} on rank {event['detected_by']}), {seconds:.2f} s; training goes on "
                f"at world size {transport.size}\n"
            )
            sys.stderr.flush()
        return missed


#: the survivors' communicator of the latest heal in this process (for :func:`_finished_at_exit`)
_HEALED: list[Any] = []


def remember_healed(base: Any) -> None:
    """``base`` is the run's communicator after a heal (or a respawn, or a replacement's join):
    the one :func:`_finished_at_exit` marks the end of training on."""
    if not _HEALED:
        atexit.register(_finished_at_exit)
    _HEALED[:] = [base]


def _finished_at_exit() -> None:
    """At the end of a process that healed: tell ``lightning-mpi --heal`` that training finished
    (:func:`~lightning_mpi.comm.ulfm.mark_finished`: a barrier of the survivors, then a mark), so
    that a job that Open MPI then keeps waiting in ``MPI_Finalize`` (it can, after ranks died) is
    ended after ``--grace`` seconds with exit code 0. Runs before mpi4py finalizes MPI; a survivor
    that never gets here (it died or raised) fails the barrier, and nothing is marked."""
    if not _HEALED:
        return
    try:
        mark_finished(_HEALED[0])
    except Exception:  # noqa: BLE001  (at exit: a failed barrier means no mark, nothing more)
        pass


class _Nothing:
    """No result was taken from another survivor: redo the operation."""


_NOTHING = _Nothing()
