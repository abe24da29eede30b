"""Live healing (``heal="shrink"``): when a rank dies, the survivors rebuild the run over
themselves and go on training, without a restart, and without losing or repeating a step.

Every strategy holds one :class:`RunHealing`. With ``heal=None`` it is inert: every call runs its
operation once and a dead rank raises ``RankFailedError`` as before. With ``heal="shrink"`` (Open
MPI with ULFM, ``lightning-mpi --heal``), the strategy runs every operation that involves the
other ranks through it:

- :meth:`RunHealing.operation`: a collective whose interruption can be redone (the rule's exchange
  ``before_step``, Lightning's ``reduce``/``all_gather``/``broadcast``/``barrier``);
- :meth:`RunHealing.between`: a check between operations (the error channel, the preemption vote),
  where nothing is left to redo.

When one of them raises :class:`~lightning_mpi.comm.ulfm.ProcessFailed`, this rank heals, with
every other survivor, wherever each of them noticed:

1. the rule is asked what it keeps (:func:`kept_state`); a rule that cannot heal yet raises
   ``RankFailedError`` saying so (every survivor alike: they run the same rule);
2. :func:`~lightning_mpi.comm.healing.heal_run`: revoke, shrink, agree, a new error channel and
   transport over the survivors, the failed run released (the rule is abandoned first);
3. with fewer survivors than ``min_ranks``: ``RankFailedError``, as without ``heal``;
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
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from lightning_mpi.comm.errors import RankFailedError
from lightning_mpi.comm.healing import HealedRun, heal_run
from lightning_mpi.comm.ulfm import ProcessFailed, process_failure, require_heal
from lightning_mpi.rules.averaging import BoundModelAveraging, averages_at
from lightning_mpi.rules.base import BoundRule
from lightning_mpi.rules.easgd import BoundEASGD
from lightning_mpi.rules.sync import BoundSync

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


#: Rules whose ranks step on their own gradients and exchange in ``after_step`` every ``period``
#: steps, with a state that each rank holds whole (``state_dict`` makes no collective): whether
#: an ``after_step`` exchanged, from the state before it and the rule after it.
_LOCAL_STEP_RULES: dict[type, Callable[[Any, dict[str, Any]], bool]] = {
    BoundModelAveraging: lambda bound, before: bound.averages != before["averages"],
    BoundEASGD: lambda bound, before: (
        bound.transport.size > 1 and bound.steps != before["steps"] and bound.steps % bound.rule.period == 0
    ),
}


def _stopped(rank: int, message: str) -> RankFailedError:
    """A ``RankFailedError`` that says why the survivors stopped instead of healing."""
    error = RankFailedError(rank, message)
    error.args = (f"lightning_mpi: {message}",)
    return error


def kept_state(bound: BoundRule | None) -> dict[str, Any]:
    """What the bound rule carries into the healed run (its state, read locally: the other ranks
    are not reachable any more); raises ``LookupError`` naming why for a rule that cannot heal yet."""
    if bound is None:
        return {}
    if type(bound) is BoundSync:
        if bound.rule.average != "gradients":
            raise LookupError(f'average={bound.rule.average!r}: only average="gradients" heals so far')
        return {"skipped_steps": bound.skipped_steps}
    if type(bound) in _LOCAL_STEP_RULES:
        # model averaging: its counters; EASGD: its counter and the center (replicated: every
        # survivor holds it whole); the weights are the module's
        return bound.state_dict()
    raise LookupError(f"{type(bound).__name__} keeps state that is not rebuilt after a heal yet")


class RunHealing:
    """Heals the run when a rank dies (module docstring); inert with ``mode=None``.

    Args:
        mode: ``None`` or ``"shrink"`` (the strategy's ``heal``); ``"shrink"`` checks at once that
            this MPI can heal (:func:`~lightning_mpi.comm.ulfm.require_heal` names the fix).
        min_ranks: fewer survivors than this raise ``RankFailedError`` (``None``: 1).
        failures: the strategy's :class:`~.failures.RunFailures` (its transport, channel, ranks).
        environment: the strategy's MPI cluster environment (:class:`~.environment.MPIClusterMixin`).
        bound: returns the bound rule (or ``None``).
        adopt: called after a heal, collectively, with the kept rule state: the strategy rebinds
            its rule on the new transport, updates what Lightning reads, restarts its vote.
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
        adopt: Callable[[dict[str, Any]], None],
        abandon: Callable[[], None],
        rule_name: str,
    ) -> None:
        self.mode = mode
        self.min_ranks = min_ranks or 1
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

    @staticmethod
    def require(mode: str | None) -> None:
        """With ``heal`` set: raise ``HealUnavailable`` (naming the fix) unless this MPI can heal."""
        if mode is not None:
            require_heal()

    @property
    def active(self) -> bool:
        return self.mode is not None

    @property
    def stats(self) -> dict[str, float]:
        """``mpi/heal/events`` (heals so far), ``mpi/heal/seconds`` (the last one's, from detection
        to training again) and ``mpi/heal/world_size``; empty without ``heal``."""
        if not self.active:
            return {}
        return {
            "mpi/heal/events": float(self.events),
            "mpi/heal/seconds": float(self.seconds),
            "mpi/heal/world_size": float(self._failures.world_size),
        }

    # -- what the strategy runs through it ------------------------------------------------------------
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
        detected = time.perf_counter()
        try:
            state = kept_state(self._bound())
        except LookupError as why:
            raise HealNotSupported(self._rule_name, str(why), failure) from error
        failures, environment = self._failures, self._environment
        old_rank, old_size = failures.rank, failures.world_size
        run: HealedRun = heal_run(
            failures.transport,
            failures.base_comm,
            serial=next(_HEAL_SERIALS),
            also=environment.derived_comms(),
            before_release=self._abandon,
        )
        assert run.healed is not None
        failures.adopt(run)
        environment.adopt(run.base)
        transport = run.transport
        if transport.size < self.min_ranks:
            raise _stopped(
                run.healed.lost[0] if run.healed.lost else -1,
                f"rank(s) {', '.join(map(str, run.healed.lost))} of {old_size} died and {transport.size} survive, "
                f"fewer than min_ranks={self.min_ranks}: the run stops (`lightning-mpi --max-restarts` relaunches it)",
            ) from error
        # Where is everyone: the operations each completed, and where each noticed.
        mine = (self.completed, where, failure.error_class, old_rank)
        everyone = transport.allgather_object(mine)
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
        if transport.rank == 0:
            lost = ", ".join(map(str, run.healed.lost))
            sys.stderr.write(
                f"lightning_mpi: healed: rank{'s' if len(run.healed.lost) > 1 else ''} {lost} of {old_size} lost "
                f"(detected in {event['where']} on rank {event['detected_by']}), {seconds:.2f} s; training goes on "
                f"at world size {transport.size}\n"
            )
            sys.stderr.flush()
        return missed


def heal_grads(healing: RunHealing, runner: Any, optimizer: Any, module: torch.nn.Module) -> bool:
    """The rule's exchange (``before_step``) as a healing operation: this rank's own gradients are
    kept before it, put back before a redo (an interrupted exchange may have averaged some
    buckets already), and the exchanged gradients are what a survivor that missed the exchange's
    completion takes (one copy of the gradients each, every step, while ``heal`` is set)."""
    params = [p for p in module.parameters() if p.requires_grad]
    own = [None if p.grad is None else p.grad.detach().clone() for p in params]

    bound = runner.bound
    # the synchronous rules exchange here every step; of the local-step rules only model averaging
    # does, in its warm-up (gradients averaged)
    if isinstance(bound, BoundModelAveraging):
        exchanges = bound.transport.size > 1 and (
            averages_at(bound.steps + 1, bound.rule.period, bound.rule.sync_warmup_steps) == "gradients"
        )
    else:
        exchanges = type(bound) not in _LOCAL_STEP_RULES

    def exchange() -> bool:
        bound = runner.bound
        assert bound is not None
        return bool(bound.before_step(optimizer))

    def put_back() -> None:
        for p, grad in zip(params, own, strict=True):
            p.grad = None if grad is None else grad.clone()

    def keep(accepted: bool) -> tuple[bool, list[torch.Tensor | None]]:
        return accepted, [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]

    def take(kept: tuple[bool, list[torch.Tensor | None]]) -> bool:
        accepted, grads = kept
        for p, grad in zip(params, grads, strict=True):
            p.grad = None if grad is None else grad.to(p.device)
        return accepted

    return healing.operation("the exchange", exchange, keep, take, put_back, counted=lambda: exchanges)


def heal_after_step(healing: RunHealing, runner: Any, optimizer: Any) -> None:
    """The rule's ``after_step`` as a healing operation where it may exchange (model averaging's
    weight average, EASGD's elastic exchange, every ``period`` steps): its state is put back
    before a redo (the exchange changes weights and center only once it completed), and a
    survivor that missed the exchange's completion takes the weights and state of one that has."""
    bound = runner.bound
    assert bound is not None
    exchanged = _LOCAL_STEP_RULES.get(type(bound))
    if not healing.active or exchanged is None:
        bound.after_step(optimizer)  # the synchronous rules exchange nothing here (average="gradients")
        return
    before = bound.state_dict()
    params = bound.params

    def average() -> None:
        runner.bound.after_step(optimizer)

    def keep(_: None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return runner.bound.state_dict(), [p.detach().cpu().clone() for p in params]

    def take(kept: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
        state, weights = kept
        runner.bound.load_state_dict(state)
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)

    def put_back() -> None:
        runner.bound.load_state_dict(before)

    healing.operation(
        "the weight average",
        average,
        keep,
        take,
        put_back,
        counted=lambda: exchanged(runner.bound, before),
    )


class _Nothing:
    """No result was taken from another survivor: redo the operation."""


_NOTHING = _Nothing()
