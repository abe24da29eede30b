"""Exchange rules: hyperparameters (a :class:`Rule`) bound to a communicator (a :class:`BoundRule`).

A :class:`Rule` holds validated hyperparameters and nothing else, so it can be built from the
command line and pickled. :meth:`Rule.bind` gives the running part, which owns buffers and state.
Rules know torch and the transport; they know nothing of Lightning. The strategy calls these
hooks, in this order, on every rank:

1. ``on_train_start()`` once, after all ranks hold rank 0's initial weights.
2. per updating step: ``before_step(optimizer)`` after backward; returns ``False`` when the step
   must be skipped (non-finite exchanged gradients), then ``after_step(optimizer)`` after it.
3. ``on_train_end()`` once: leave the rule's final consensus weights in the parameters.
4. ``close()``: release threads, windows and requests.

``state_dict()`` / ``load_state_dict()`` carry what a resumed run needs beyond the module and
optimizer states; ``stats()`` returns numbers worth logging for the last step.

**Healing is part of the contract.** The strategy runs the three step hooks through
:meth:`BoundRule.healable_before_step`, :meth:`~BoundRule.healable_after_step` and
:meth:`~BoundRule.healable_train_end`, which hand it each collective of the hook as an
:class:`Operation`: what to keep before it, how to put back what an interrupted attempt changed
and redo it, and how to take its result from a survivor that completed it. Without ``heal`` an
operation is just run (:class:`RunDirectly`); under ``heal`` the strategy's executor redoes or takes
it after a rank died. What a rule carries through a heal is :meth:`BoundRule.heal_state` (by
default its checkpoint state), and what rank 0 hands to ranks let in is
:meth:`BoundRule.hand_over`. Each rule's docstring says what it keeps and what it redoes; the
strategy names no rule class.

Every bound rule checks at bind time that its parameters sit on one device
(:func:`check_single_device`). Rules whose ranks step on their own gradients (elastic, model
averaging, parameter server, gossip) reject a step whose local gradients hold inf or NaN with a
:class:`LocalStepGuard`, so that a NaN loss on one rank never reaches the weights, the center or
the other ranks.
"""

from __future__ import annotations

import dataclasses
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import validate


def check_single_device(params: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless every parameter sits on one device.

    Every rule refuses a model spread over several devices inside one rank (model parallelism):
    the elastic, server and gossip rules keep all parameters in one flat buffer on one device,
    and although the synchronous rules bucket per device, the strategy places the whole model on
    one device per rank (``root_device``), so a second device can only come from parameters that
    were never placed (e.g. left on ``meta``): a mistake to report early, not a layout to serve.
    """
    devices = sorted({str(p.device) for p in params})
    if len(devices) <= 1:
        return
    hint = ""
    if "meta" in devices:
        hint = (
            " Parameters on 'meta' hold no data yet: materialise them first (e.g. module.to_empty(device=...) "
            "and initialise them) before training."
        )
    raise ValueError(
        f"lightning_mpi: the trainable parameters sit on {len(devices)} devices ({', '.join(devices)}), but an "
        "exchange rule needs every one of them on one device per rank. Keep the model on one device "
        "(e.g. model.to(device); MPIStrategy puts rank r on device local_rank % devices_per_host) and "
        f"run one rank per device instead of spreading one model over several.{hint}"
    )


def grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """True when no parameter's gradient holds inf or NaN (a missing gradient counts as finite).

    One sum per gradient (inf or NaN anywhere makes it non-finite), then a single check of all
    of them, so that a GPU synchronises once per step, not once per parameter.
    """
    # 16-bit gradients are summed in float32: a finite fp16 gradient can sum past 65504
    sums = [
        p.grad.sum(dtype=torch.float64 if p.grad.dtype == torch.float64 else torch.float32)
        for p in params
        if p.grad is not None
    ]
    if not sums:
        return True
    return bool(torch.isfinite(torch.stack([s.double() for s in sums])).all())


def all_finite(buffers: Sequence[torch.Tensor]) -> bool:
    """True when no buffer holds inf or NaN.

    One vectorised float32 sum per buffer: inf or NaN anywhere makes the sum non-finite. (A
    float64 sum would also rule out overflow of the sum itself, but costs ~30x more; a finite
    gradient whose sum overflows float32 needs entries near 1e38, which is no usable step either.)
    """
    return all(bool(torch.isfinite(b.sum())) for b in buffers)


class LocalStepGuard:
    """Rejects a rank's own step when its local gradients hold inf or NaN.

    For rules whose ranks step on their own gradients (elastic and model averaging, parameter
    server, gossip): no exchange sees the gradients before the optimizer does, so without this a
    NaN loss on one rank would make that rank's weights NaN, and the next exchange would carry
    them into the center, the average or a peer. A rejected step skips the optimizer update on
    this rank only (no collective: asynchronous rules must not wait) and is counted in
    :attr:`skipped_steps`, with one warning per run.

    The rejected step still counts as a step of the rule: collective exchanges (EASGD, model
    averaging) happen every ``period`` steps on every rank, so a rank that stopped counting would
    call them at other steps than the rest and mix up or hang the job.
    :class:`BoundLocalStepRule` holds the protocol.
    """

    def __init__(self, rule_name: str) -> None:
        self.rule_name = rule_name
        self.skipped_steps = 0
        self._counted = False

    def accept(self, params: Sequence[torch.Tensor]) -> bool:
        """True when this rank's gradients are finite; else count, warn once and return False."""
        self._counted = False
        if grads_finite(params):
            return True
        self.skipped_steps += 1
        self._counted = True
        if self.skipped_steps == 1:
            warnings.warn(
                f"lightning_mpi: non-finite local gradients (inf/NaN loss?) on this rank; rule {self.rule_name!r} "
                "skips this rank's update and keeps counting the step. Further skips are counted in "
                "stats()['skipped_steps'] without a warning.",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def already_counted(self) -> bool:
        """True (once) when ``before_step`` rejected and counted this step itself."""
        counted, self._counted = self._counted, False
        return counted


T = TypeVar("T")


def _nothing(_bound: Any) -> None:
    return None


def _put_nothing_back(_bound: Any, _started: Any) -> None:
    return None


def _sent_as_is(_bound: Any, value: Any) -> Any:
    return value


def _taken_as_is(_bound: Any, sent: Any, _started: Any) -> Any:
    return sent


def _always(_bound: Any, _started: Any) -> bool:
    return True


def never(_bound: Any, _started: Any) -> bool:
    """``collective`` of an operation that goes over no wire (a local step, a guard)."""
    return False


@dataclass(frozen=True)
class Operation(Generic[T]):
    """One part of a rule's hook that involves the other ranks, in the shape a heal can keep, redo or
    take.

    Every callable receives the binding it acts on: a heal binds the rule anew over the survivors,
    and a redo or a take acts on that new binding, never on the one that failed. Run without
    ``heal`` (:class:`RunDirectly`), an operation is ``run(bound)`` and nothing else, so building
    one costs a few closures and no copy.

    Attributes:
        where: what it is, for the heal's message ("the exchange").
        run: the operation itself; reads the binding's transport afresh on every attempt.
        start: under ``heal`` only, once before the first attempt: what a redo or a take needs of the
            state before it (``started``).
        put_back: ``(bound, started)``: restore what an interrupted attempt may have changed, before
            the operation is redone on the healed run.
        result: ``(bound, value)``: what a survivor that completed the operation sends (picklable)
            to one that did not.
        take: ``(bound, sent, started)``: on a survivor that missed the completion, the result from
            what was sent.
        collective: ``(bound, started)``, asked once the operation completed: whether it went over
            the wire; a hook that exchanged nothing this step is no operation to reconcile.
        redo: ``False`` for a one-sided step (a gossip push, a commit to a parameter server): after a
            heal it is not redone, nor taken; the rule rebuilds what it left when it is bound again.
    """

    where: str
    run: Callable[[Any], T]
    start: Callable[[Any], Any] = _nothing
    put_back: Callable[[Any, Any], None] = _put_nothing_back
    result: Callable[[Any, T], Any] = _sent_as_is
    take: Callable[[Any, Any, Any], T] = _taken_as_is
    collective: Callable[[Any, Any], bool] = _always
    redo: bool = True

    def on(self, part: Callable[[Any], Any]) -> Operation[T]:
        """The same operation on ``part(bound)`` (``mpi_auto``'s arm) of the binding it is given."""
        return dataclasses.replace(
            self,
            run=lambda bound: self.run(part(bound)),
            start=lambda bound: self.start(part(bound)),
            put_back=lambda bound, started: self.put_back(part(bound), started),
            result=lambda bound, value: self.result(part(bound), value),
            take=lambda bound, sent, started: self.take(part(bound), sent, started),
            collective=lambda bound, started: self.collective(part(bound), started),
        )


class Execute(Protocol):
    """Runs a rule's operations: directly (:class:`RunDirectly`), or, under ``heal``, the strategy's
    executor, which redoes or takes them after a rank died."""

    @property
    def bound(self) -> BoundRule:
        """The binding operations act on now (a heal binds the rule anew)."""
        ...

    def __call__(self, operation: Operation[T]) -> T: ...


class RunDirectly:
    """Runs every operation once on ``bound``: a hook without ``heal``."""

    def __init__(self, bound: BoundRule) -> None:
        self.bound = bound

    def __call__(self, operation: Operation[T]) -> T:
        return operation.run(self.bound)


class RunPart:
    """Runs the operations of ``part(whole.bound)`` (``mpi_auto``'s arm) through ``whole``'s executor,
    so that a heal redoes them on the part of the healed binding."""

    def __init__(self, whole: Execute, part: Callable[[Any], BoundRule]) -> None:
        self._whole = whole
        self._part = part

    @property
    def bound(self) -> BoundRule:
        return self._part(self._whole.bound)

    def __call__(self, operation: Operation[T]) -> T:
        return self._whole(operation.on(self._part))


def _grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def gradient_exchange(optimizer: Optimizer, collective: bool = True) -> Operation[bool]:
    """``before_step`` of a rule that averages gradients, as an operation: this rank's own gradients
    are kept before it and put back before a redo (an interrupted exchange may have averaged some
    buckets already); a survivor that completed it sends the exchanged gradients with the state
    the exchange changes alike on every rank (:meth:`BoundRule.replicated_state`), and one that
    missed it takes both, and its own feedback as that exchange leaves it
    (:meth:`BoundRule.took_exchange`). ``collective``: whether it goes over the wire this step."""

    def put_back(bound: BoundRule, own: list[torch.Tensor | None]) -> None:
        for p, grad in zip(bound.params, own, strict=True):
            p.grad = None if grad is None else grad.clone()

    def result(bound: BoundRule, accepted: bool) -> tuple[bool, list[torch.Tensor | None], dict[str, Any]]:
        grads = [None if p.grad is None else p.grad.detach().cpu().clone() for p in bound.params]
        return accepted, grads, bound.replicated_state()

    def take(bound: BoundRule, sent: tuple[bool, list[torch.Tensor | None], dict[str, Any]], own: Any) -> bool:
        accepted, grads, replicated = sent
        for p, grad in zip(bound.params, grads, strict=True):
            p.grad = None if grad is None else grad.to(p.device)
        if replicated:
            bound.load_state_dict(replicated)
            bound.took_exchange(own)
        return accepted

    return Operation(
        "the exchange",
        lambda bound: bound.before_step(optimizer),
        start=lambda bound: _grads(bound.params),
        put_back=put_back,
        result=result,
        take=take,
        collective=lambda _bound, _own: collective,
    )


def redone_from_state(
    where: str,
    run: Callable[[Any], None],
    moving: Callable[[Any], list[torch.Tensor]],
    exchanged: Callable[[Any, dict[str, Any]], bool],
    restore: bool,
) -> Operation[None]:
    """A hook that changes the rule's state and the tensors ``moving(bound)`` (the weights, and
    what else it averages), as an operation redone from the rule's :meth:`~BoundRule.heal_state`:
    that state is kept before it and put back before a redo, with the tensors as they were where
    ``restore`` (an exchange that may have written some of them already); a survivor that missed
    the completion takes the state and the tensors of one that completed it, keeping its own part
    (``"local"``: its residuals as before the exchange, whose compression error on this rank is
    then not fed back). ``exchanged(bound, before)``: whether it went over the wire, from the
    binding after it and the state before it."""

    def start(bound: BoundRule) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return bound.heal_state(), [t.detach().clone() for t in moving(bound)] if restore else []

    def put_back(bound: BoundRule, started: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
        before, values = started
        bound.load_state_dict(before)
        with torch.no_grad():
            for t, value in zip(moving(bound) if restore else [], values, strict=True):
                t.copy_(value)

    def result(bound: BoundRule, _: None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return bound.heal_state(), [t.detach().cpu().clone() for t in moving(bound)]

    def take(bound: BoundRule, sent: tuple[dict[str, Any], list[torch.Tensor]], started: Any) -> None:
        state, values = sent
        before = started[0]
        if "local" in state and "local" in before:
            state = {**state, "local": before["local"]}
        bound.load_state_dict(state)
        with torch.no_grad():
            for t, value in zip(moving(bound), values, strict=True):
                t.copy_(value)

    return Operation(
        where,
        run,
        start=start,
        put_back=put_back,
        result=result,
        take=take,
        collective=lambda bound, started: exchanged(bound, started[0]),
    )


def one_sided(where: str, run: Callable[[Any], None]) -> Operation[None]:
    """A step that involves no other rank's participation (a gossip push, a commit to a parameter
    server): a loss it notices heals, and nothing is redone (the rule settles what it left when it
    is bound again over the survivors)."""
    return Operation(where, run, collective=never, redo=False)


class OptimizerShards(Protocol):
    """What a rule that steps only this rank's shard of the optimizer (ZeRO) offers the strategy
    (:attr:`BoundRule.optimizer_shards`): it takes the user's optimizer, clips by the norm over
    every rank's shard, and saves and loads this rank's shard."""

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer it shards, once it took one."""
        ...

    @property
    def same_weights(self) -> bool:
        """Whether every rank holds the same weights whenever the strategy saves (so that a sharded
        checkpoint may spread them over the ranks' files); False where they may differ (replicas
        stepping apart)."""
        ...

    def take_optimizer(self, optimizer: Optimizer, previous: BoundRule | None) -> bool:
        """Rebuild ``optimizer`` (the one optimizer of the model) in place over this rank's shard;
        after a heal (collective) rebuild its state from the survivors' (``previous``: the binding
        before the heal). Returns whether this rank's shard was rebuilt at a let-in (``heal="replace"``),
        so that the optimizer state handed over to it is not loaded over it."""
        ...

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model (collective)."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer shard, for a sharded checkpoint (every rank writes its own)."""
        ...

    def load_optimizer_state(self, saved: Any) -> None:
        """Load torch's format, one shard, or every shard of a sharded save (any world size)."""
        ...


class BoundRule:
    """The running part of a rule. The default hooks do nothing, so a rule overrides only what it uses.

    Besides the hooks, these attributes are part of the contract that the strategies rely on
    (a rule that has no use for one keeps the default):

    - ``sync_enabled``: the strategy sets it to ``False`` while gradients accumulate without an
      update (Lightning's accumulation, Fabric's ``no_backward_sync``); a rule whose gradient
      hooks start exchanges during backward must not start them then.
    - ``training``: ``True`` from ``on_train_start`` until ``on_train_end`` (or an aborted fit).
    - ``healing``: the strategy sets it right after binding when it heals lost ranks (``heal``): a
      rule then keeps, while an exchange is in flight, what that exchange started from, so that
      :meth:`heal_state` can start it again over the survivors.
    - ``board``: a :class:`~lightning_mpi.comm.window.DecisionBoard` on which stop decisions are
      published one-sidedly while ``training``, or ``None`` when decisions must be collectives.

    Raises:
        ValueError: the parameters sit on more than one device (see :func:`check_single_device`).
    """

    sync_enabled: bool = True
    training: bool = False
    healing: bool = False
    board: Any | None = None

    def __init__(self, transport: Transport, params: Sequence[torch.Tensor]) -> None:
        self.transport = transport
        self.params = list(params)
        check_single_device(self.params)

    def on_train_start(self) -> None:
        """Called once when training starts, with identical weights on every rank."""

    def before_step(self, optimizer: Optimizer) -> bool:
        """Called after backward on a step that updates; return ``False`` to skip the update."""
        return True

    def after_step(self, optimizer: Optimizer) -> None:
        """Called after ``optimizer.step()``."""

    def on_train_end(self) -> None:
        """Called once when training ends; leaves the final consensus weights in ``params``."""

    def close(self) -> None:
        """Release background resources. Safe to call twice."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or what :meth:`heal_state` kept."""

    def stats(self) -> dict[str, float]:
        """Numbers about the last step (seconds, bytes, counts) for the logger."""
        return {}

    # -- the hooks as a heal runs them (module docstring) ---------------------------------------------
    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        """``before_step`` as operations run by ``execute``. By default one operation that goes over
        no wire (a local guard): after a heal it is redone on the healed binding. A rule that
        exchanges gradients here returns :func:`gradient_exchange`."""
        return execute(Operation("the exchange", lambda bound: bound.before_step(optimizer), collective=never))

    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        """``after_step`` as operations run by ``execute``; by default one that goes over no wire."""
        execute(Operation("the step's end", lambda bound: bound.after_step(optimizer), collective=never))

    def healable_train_end(self, execute: Execute) -> None:
        """``on_train_end`` as operations run by ``execute``; by default one that goes over no wire."""
        execute(Operation("the end of training", lambda bound: bound.on_train_end(), collective=never))

    # -- what a heal keeps ----------------------------------------------------------------------------
    @property
    def restart_after_heal(self) -> bool:
        """Whether a heal starts the new binding (``on_train_start``, collective): while training."""
        return self.training

    def heal_state(self) -> dict[str, Any]:
        """What this rank carries into the healed run, read on this rank alone (the others may be
        gone): what the new binding's :meth:`load_state_dict` takes, with this rank's own part
        (residuals) under ``"local"``. By default the checkpoint state; a rule whose
        :meth:`state_dict` is collective, or that keeps more through a heal, overrides it. A rule that
        cannot heal raises ``LookupError`` saying why (the run then fails as without ``heal``)."""
        return self.state_dict()

    def hand_over(self, kept: dict[str, Any], joining: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """On rank 0 when ``joining`` new ranks are let in (``heal="replace"``): from what it kept
        (:meth:`heal_state`), the state rank 0 binds the rule again with, and the state each new
        rank takes (it starts from rank 0's weights). By default rank 0 keeps all of it and a new
        rank takes it without rank 0's own part (``"local"``), starting with none of its own."""
        return kept, {key: value for key, value in kept.items() if key != "local"}

    @property
    def optimizer_shards(self) -> OptimizerShards | None:
        """A rule that steps only this rank's shard of the optimizer (ZeRO): what the strategy hands
        the optimizer to, clips and checkpoints through; ``None`` (the default): the optimizer is
        the user's, whole."""
        return None

    @property
    def exchange_in_flight(self) -> bool:
        """Whether an exchange was started and has not arrived (a new rank cannot join one started
        without it: ranks are let in at a step where none is)."""
        return False

    def replicated_state(self) -> dict[str, Any]:
        """For a rule that averages gradients (:func:`gradient_exchange`): what every rank holds alike
        after an exchange and the exchange changes (counters, warm starts), sent with the exchanged
        gradients to a survivor that missed the exchange's completion. None by default."""
        return {}

    def took_exchange(self, own_grads: Sequence[torch.Tensor | None]) -> None:
        """After a heal, this rank took the result of the exchange it was in from a survivor
        (:func:`gradient_exchange`); ``own_grads`` were its own gradients. A rule with error feedback
        sets its feedback to what that exchange leaves."""


class BoundLocalStepRule(BoundRule):
    """A running rule whose ranks step on their own gradients, guarded by a :class:`LocalStepGuard`.

    Subclasses implement :meth:`_advance` (count one step, and exchange when one is due). A step
    whose local gradients are non-finite is rejected in :meth:`before_step` and advanced there;
    any other step is advanced in :meth:`after_step`. Advancing a rejected step from
    ``before_step`` keeps the exchange at the same point relative to any other collective of the
    step (nothing else runs between ``before_step`` and ``after_step``), and ``after_step`` does
    not count it twice when a GradScaler makes the strategy call it anyway.
    """

    def __init__(self, transport: Transport, params: Sequence[torch.Tensor], rule_name: str) -> None:
        super().__init__(transport, params)
        self.guard = LocalStepGuard(rule_name)

    def before_step(self, optimizer: Optimizer) -> bool:
        """Reject this rank's step when its own gradients are non-finite (the step still counts)."""
        if self.guard.accept(self.params):
            return True
        self._advance()
        return False

    def after_step(self, optimizer: Optimizer) -> None:
        if not self.guard.already_counted():
            self._advance()

    def _advance(self) -> None:
        """Count one local step; exchange when one is due."""
        raise NotImplementedError


class Rule(ABC):
    """Hyperparameters of an exchange rule: a keyword-only dataclass of options.

    Subclasses are made with :func:`~lightning_mpi.options.options_class` and declare each
    hyperparameter once, with :func:`~lightning_mpi.options.option` (type, default, one line of
    doc, check). Construction runs every option's check, then :meth:`check_together`, so a bad
    value raises ``ValueError`` naming it, its value and the fix.
    """

    #: Short name used in logs (``mpi/<name>/...``).
    name: ClassVar[str] = "rule"
    #: Whether ranks step without waiting for each other. The strategies then answer Lightning's
    #: stop decisions one-sidedly, vote on preemption without lockstep, and offer
    #: ``implicit_momentum_correction``.
    asynchronous: ClassVar[bool] = False

    def __post_init__(self) -> None:
        validate(self)
        self.check_together()

    def check_together(self) -> None:  # noqa: B027  (a hook: most rules have nothing to check together)
        """Checks that involve several options (each option's own check has run already)."""

    @property
    def own_momentum(self) -> float | None:
        """The momentum the rule itself applies to the workers' steps (EAMSGD's δ), which the
        strategies' ``implicit_momentum_correction`` corrects at bind time; ``None``: it has none."""
        return None

    def with_momentum(self, momentum: float) -> Rule:
        """This rule with its own momentum set to ``momentum`` (a rule whose :attr:`own_momentum`
        is not ``None`` overrides it)."""
        raise TypeError(f"{type(self).__name__} applies no momentum of its own (own_momentum is None)")

    @abstractmethod
    def bind(self, transport: Transport, params: Sequence[torch.Tensor]) -> BoundRule:
        """Create the running rule over ``params`` (the trainable parameters, in model order)."""
