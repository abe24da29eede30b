"""``mpi_auto``: the exchange chosen from the measured link and compute, and changed when they move.

The rule measures, on every rank, the compute time of a step (:class:`~lightning_mpi.rules.link.probe.StepClock`)
and the link (:class:`~lightning_mpi.rules.link.probe.LinkProbe`: a tiny Allreduce for the latency, one of 1 MiB for the
bandwidth), times a dry run of every every-step arm the link does not rule out (one fp16 ASA
exchange of the gradient size; one PowerSGD step on copies of the real gradients; again at a
later decision only where the link moved past a factor 2 since), agrees the
numbers over the ranks (their maxima), and picks an arm with :func:`~.choice.choose`:
every-step ASA with an fp16 wire where what it adds to a step hides behind backward, PowerSGD
in the middle, and where neither does, Streaming DiLoCo at its defaults, with the period its
own ``period="auto"`` picks where the exchange needs a longer one to hide (on several hosts of
several ranks, ``mpi_hybrid`` instead where every step inside a host hides: its hosts are found at
bind, one Allgather of the ranks' host keys, and each decision times the exchange inside them over
a communicator of this rank's host, :attr:`BoundAuto.host`)::

    steps 1 .. 5       mpi_streaming_diloco at its defaults, whose first exchange comes after
                       step 12, so local steps: the first is not timed, the next 4 are
    after step 5       measure, agree, choose; switch to the chosen arm (none where the
                       choice is the defaults' plan: nothing is exchanged for the switch)
    6 steps after a switch, and every measure_every steps otherwise (more rarely where
    the link probe would cost more than 1% of the steps between two: a slow link)
                       measure again (and take the arm's own exposed time per step);
                       switch when the choice changed (hysteresis in .choice)

Every input of a decision is agreed before it is used, and decisions happen at the same step on
every rank (the step count is the same everywhere), so ranks never diverge in their choice. The
same holds for what a decision runs: which collectives, and how many, follow from agreed values
only (the arm in use, the agreed measurements), never from a rank's own clock or state, since a
rank that joined one Allreduce more than the others would hang them all (issue 25).

The arms are the existing rules, held by composition (:mod:`.arms`): :class:`BoundAuto`
holds the bound rule of the arm in use and delegates every hook to it. A switch happens in
``after_step``, where every rank is, after the update:

- leaving Streaming DiLoCo: its ``on_train_end`` averages the replicas (what is in flight and
  the steps since each fragment's last exchange) and leaves that mean, θ_global, identical on
  every rank; for an every-step arm, the inner optimizer's per-parameter state (momentum, Adam's
  moments), which differed between ranks, is averaged, so every rank continues from the same
  state (Streaming DiLoCo keeps each rank's own, as it does between its exchanges);
- leaving an every-step arm: weights and optimizer state are already identical on every rank;
- the new arm is bound to the same parameters and started (``on_train_start``);
- except from Streaming DiLoCo to a plan of it that differs only in period and τ, before its
  first exchange (the first decision, at step 5): that is set in place
  (:meth:`~lightning_mpi.rules.diloco.rule.BoundDiLoCo.reschedule`), as if the arm had been bound with it.

The hooks are one piece of code with and without ``heal``: each runs the arm's own hook as that
arm's operations (:class:`~lightning_mpi.rules.base.RunPart`), with a decision between them as one
more operation (:meth:`BoundAuto.decision`), through whatever runs them
(:class:`~lightning_mpi.rules.base.RunDirectly` without ``heal``; the strategy's executor with it).

Healing (``heal="shrink"``, and the survivors of ``heal="replace"``): a survivor keeps its decisions'
state and the arm's own as that arm keeps it (:meth:`BoundAuto.heal_state`); the arm's exchanges
heal and are redone as that arm's do, and a decision is one healing operation (the probe, the dry
runs, the agreement of their numbers and the switch), redone over the survivors from the state,
weights and optimizer state it started from, or taken from a survivor that completed it.

On the healed run the survivors agree on the arm to bind and re-decide, with fresh
measurements (link probe, dry runs, step time) over the new world size, at the step after the
furthest survivor's, or at the step of a decision that the loss interrupted
(:mod:`.heal`): every survivor ends each heal with the same arm and the same schedule.

Checkpoints carry the arm in use, its own state and the decisions' counters; a resumed run binds
the same arm and loads its state, so it continues exactly as the arm would. Later decisions depend
on fresh timings. What a checkpoint and a heal hold of the decisions (the counters are read on this
rank alone, :meth:`BoundAuto.counters`):

- ``state_dict()`` (a checkpoint: a resumed run binds the same arm and loads its state)::

      {"choice", "steps", "next_decision", "decisions", "switches", "measured", "observed",
       "inner": the arm's state_dict()}

- what a survivor keeps through a heal (:meth:`BoundAuto.heal_state`)::

      {<the counters>, "healed": True, "deciding": inside a decision?,
       "inner": the arm's kept state, "local": this rank's own part of it (where the arm has one)}

  loaded on the healed run as the survivors agree (:func:`~.heal.plan_after_heal`).

The arm in use is saved with the counters but bound by the rule (binding is collective), so
:meth:`BoundAuto.load_counters` puts back everything but it. What the rule says about its
decisions (rank 0's one line per decision that changed the arm, and for the first decision and the
first after a heal; the ``mpi/auto/*`` numbers of its ``stats()``) is built by the pure functions
:func:`announcement` and :func:`decision_stats`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.auto.arms import LOCAL_STEP_ARMS, average_optimizer_state, bind_arm, optimizer_float_state
from lightning_mpi.rules.auto.choice import (
    Choice,
    Sizes,
    choose,
    default_plan,
    still_valid,
)
from lightning_mpi.rules.auto.heal import plan_after_heal
from lightning_mpi.rules.auto.measure import DecisionProbe, measure_interval
from lightning_mpi.rules.base import BoundRule, Execute, Operation, Rule, RunDirectly, RunPart
from lightning_mpi.rules.diloco.rule import BoundDiLoCo
from lightning_mpi.rules.hybrid.layout import host_key, replica_table
from lightning_mpi.rules.link.probe import Measurement, StepClock

#: Steps before the first decision; the first is not timed (caches, allocators warm up).
PROBE_STEPS = 5
#: Steps after a switch before the next decision (at most ``measure_every``): an arm's own cost
#: (PowerSGD's matrix products, Python's overhead per bucket) is seen soon, not ``measure_every``
#: steps later.
CONFIRM_STEPS = 6
#: The arm in use as a number, for the logs.
ARM_CODES = {"probing": -1.0, "sync": 0.0, "powersgd": 1.0, "streaming": 2.0, "hybrid": 3.0}
#: Bits per value of a choice's wire, for the logs (0: the arm has no wire setting).
WIRE_BITS = {"": 0.0, "fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "int8": 8.0, "int4": 4.0}


@options_class
class AutoRule(Rule):
    """The exchange chosen from the measured link and compute (``mpi_auto``): every-step ASA with an
    fp16 wire where it hides behind backward, PowerSGD in the middle (each timed in a dry run
    before it is chosen), and Streaming DiLoCo at its defaults (the period raised where the
    exchange needs more steps to hide) where no every-step exchange hides; on several hosts of
    several ranks, two levels there (``mpi_hybrid``: every step inside each host, where that hides,
    and Streaming DiLoCo across hosts); measured again every
    ``measure_every`` steps and switched, at a step every rank agrees on, when the choice moves.
    Logs its choice and why under ``mpi/auto/*`` and prints one line per change (and one for the first
    decision) on rank 0.
    """

    name = "auto"

    measure_every: int = option(
        default=100,
        doc="steps between measurements after the first decision (≥ 0; 0: decide once, after step 5, and once "
        "after each heal), more where the link probe would cost more than 1% of their compute (a slow link); after "
        "a switch the next one comes within 6 steps, so that the new arm's own cost is seen early.",
        check=integer(0),
    )
    tolerance: float = option(
        default=0.1,
        doc="the share of a step's compute an every-step exchange may add (in (0, 1)); above it, a cheaper arm.",
        check=number(0.0, 1.0, low_open=True, high_open=True),
    )

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundAuto:
        return BoundAuto(self, transport, params)


class BoundAuto(BoundRule):
    """The running ``mpi_auto``: the bound rule of the arm in use, and the decisions (module docstring)."""

    def __init__(self, rule: AutoRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        #: under ``heal``: the state a decision in progress started from (what a heal keeps then)
        self.deciding: dict[str, Any] | None = None
        self.rule = rule
        #: the host of every rank (as mpi_hybrid finds hosts), and this rank's host's communicator
        #: where the run spans several hosts of several ranks (the decisions time the exchange inside)
        hosts = replica_table(transport.allgather_object(host_key(None))) if transport.size > 1 else [0]
        self.sizes = Sizes.of([tuple(p.shape) for p in self.params], transport.size, hosts)
        self.host: Transport | None = transport.split(hosts[transport.rank]) if self.sizes.two_levels else None
        # The first steps train mpi_streaming_diloco at its defaults (its first exchange comes after
        # the first decision), so where the decision keeps it nothing is switched. One rank: nothing
        # to measure or exchange (a plain every-step rule is a no-op there).
        self.choice = default_plan(self.sizes) if transport.size > 1 else Choice("sync", "fp16")
        self.inner: BoundRule = bind_arm(self.choice, transport, self.params)
        self.steps = 0
        self.next_decision = PROBE_STEPS
        self.decisions = 0
        self.switches = 0
        self.measured: Measurement | None = None
        self.reason = "measuring the first steps"
        self.clock = StepClock()
        self.held: deque[float] = deque(maxlen=16)  # seconds the arm's hooks held each step
        self._held = 0.0
        self._exchange_started = time.perf_counter()
        self._announce_next = False  # the first decision after a heal is announced too
        self._counted = False
        self._observed_share = 0.0
        #: arm -> (exposed seconds per step seen in it, the link bandwidth then), agreed over ranks
        self.observed: dict[str, tuple[float, float]] = {}

    # -- delegation -----------------------------------------------------------------------------------
    @property  # the strategy's switch reaches the arm in use
    def sync_enabled(self) -> bool:
        return self.inner.sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self.inner.sync_enabled = value

    @property  # the strategy sets it after binding: every arm bound from then on heals as it does
    def healing(self) -> bool:
        return self.inner.healing

    @healing.setter
    def healing(self, value: bool) -> None:
        self.inner.healing = value

    @property
    def exchange_in_flight(self) -> bool:
        return self.inner.exchange_in_flight

    def on_train_start(self) -> None:
        self.inner.on_train_start()

    # -- the hooks: the arm's, with the decisions between them (module docstring) ---------------------
    def before_step(self, optimizer: Optimizer) -> bool:
        return self.healable_before_step(optimizer, RunDirectly(self))

    def after_step(self, optimizer: Optimizer) -> None:
        self.healable_after_step(optimizer, RunDirectly(self))

    def on_train_end(self) -> None:
        self.healable_train_end(RunDirectly(self))

    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        """The arm's exchange (its own operations); then, where a local-step arm rejected this rank's
        step and a decision is due, the decision. After each operation the binding is read again
        from ``execute``: a heal binds ``mpi_auto`` anew."""
        _auto(execute).begin_exchange()
        arm = RunPart(execute, _arm)
        accepted = arm.bound.healable_before_step(optimizer, arm)
        if _auto(execute).end_exchange(accepted):
            execute(self.decision(optimizer))
        return accepted

    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        """The arm's ``after_step`` (its own operations), then the decision where one is due."""
        start = time.perf_counter()
        arm = RunPart(execute, _arm)
        arm.bound.healable_after_step(optimizer, arm)
        if _auto(execute).end_step(time.perf_counter() - start):
            execute(self.decision(optimizer))
        _auto(execute).clock.resume()

    def healable_train_end(self, execute: Execute) -> None:
        """The arm's ``on_train_end`` (its own operations: Streaming DiLoCo's final average)."""
        arm = RunPart(execute, _arm)
        arm.bound.healable_train_end(arm)

    def begin_exchange(self) -> None:
        """Before the arm's ``before_step``: the step's compute ends here."""
        self.clock.pause()
        self._exchange_started = time.perf_counter()

    def end_exchange(self, accepted: bool) -> bool:
        """After the arm's ``before_step``; True when this step was counted here and a decision is due.

        A local-step arm that rejected this rank's own step (non-finite gradients): the strategy
        skips ``after_step`` on this rank only, but the step counts on every rank, so it is counted
        (and decided, if due) here; the other ranks do the same in ``after_step``, and nothing
        collective runs between the two points."""
        self._held = time.perf_counter() - self._exchange_started
        if not accepted and self.choice.arm in LOCAL_STEP_ARMS:
            self._counted = True
            return self._count_step()
        return False

    def end_step(self, seconds: float) -> bool:
        """After the arm's ``after_step`` (which held the step ``seconds``); True when a decision is due."""
        self.held.append(self._held + seconds)
        if self._counted:  # counted in before_step (a GradScaler makes the strategy call this anyway)
            self._counted = False
            return False
        return self._count_step()

    def _count_step(self) -> bool:
        self.steps += 1
        return self._decision_due()

    def close(self) -> None:
        self.inner.close()
        if self.host is not None:
            self.host.free()
            self.host = None

    # -- decisions ------------------------------------------------------------------------------------
    def _decision_due(self) -> bool:
        return self.transport.size > 1 and self.steps == self.next_decision

    def _measure(self) -> tuple[Measurement, float | None]:
        """Collective: this decision's measurement and the arm's observed exposed seconds, agreed
        (:class:`~.measure.DecisionProbe`)."""
        probe = DecisionProbe(self.transport, self.params, self.sizes, self.rule.tolerance, self.host)
        return probe.measure(self.clock.seconds() or 1e-3, self.choice.arm, self.held, self.observed)

    def decide(self, optimizer: Optimizer) -> None:
        """Measure, agree, choose, and switch where the choice changed (collective)."""
        self.measured, observed = self._measure()
        bandwidth = self.measured.link.bandwidth
        self._observed_share = 0.0 if observed is None else observed / self.measured.step_seconds
        if observed is not None:
            self.observed[self.choice.arm] = (observed, bandwidth)
        # an observation counts while the link is within a factor 2 of the one it was made on
        valid = {arm: seconds for arm, (seconds, seen) in self.observed.items() if still_valid(seen, bandwidth)}
        choice, self.reason = choose(
            self.measured.step_seconds,
            self.measured.link,
            self.sizes,
            self.choice,
            valid,
            self.rule.tolerance,
            first=self.decisions == 0,
        )
        self.decisions += 1
        # the probe's cost, from the agreed link: a slow link is probed more rarely
        every = measure_interval(self.rule.measure_every, self.measured, self.transport.size, self.sizes.numel)
        if choice != self.choice:
            self._switch(choice, optimizer)
            every = min(every, CONFIRM_STEPS) if every > 0 else 0
        elif self.decisions == 1 or self._announce_next:  # the first decision (after a heal) kept the plan: say so
            self._announce(choice)
        self._announce_next = False
        self.next_decision = self.steps + every if every > 0 else -1

    def _switch(self, choice: Choice, optimizer: Optimizer) -> None:
        """Hand over to ``choice``'s rule at this step (every rank is here; see the module docstring)."""
        previous = self.choice
        if not self._reschedule(previous, choice):
            if previous.arm in LOCAL_STEP_ARMS:
                self.inner.on_train_end()  # every rank now holds θ_global
                if choice.arm in ("sync", "powersgd"):  # a local-step arm keeps each rank's own state
                    average_optimizer_state(self.transport, self.params, optimizer)
            self._bind(choice)
            self.inner.on_train_start()
            if isinstance(self.inner, BoundDiLoCo):
                self.inner.replicas.remember(optimizer)
        self.choice = choice
        self.switches += 1
        self.held.clear()
        self._announce(choice)

    def _reschedule(self, previous: Choice, choice: Choice) -> bool:
        """Streaming DiLoCo to Streaming DiLoCo with the same wire and fragments, before the arm's
        first exchange (the first decision): its new period and τ are set in place, with no
        averaging and no new binding (:meth:`~lightning_mpi.rules.diloco.rule.BoundDiLoCo.reschedule`);
        same on every rank."""
        same = previous.arm == choice.arm == "streaming" and (previous.wire, previous.fragments) == (
            choice.wire,
            choice.fragments,
        )
        return (
            same and isinstance(self.inner, BoundDiLoCo) and self.inner.reschedule(choice.period, choice.overlap_steps)
        )

    def _bind(self, choice: Choice) -> None:
        """Close the arm in use and bind ``choice``'s (collective: an arm's binding duplicates the
        communicator)."""
        enabled, healing = self.inner.sync_enabled, self.inner.healing
        self.inner.close()
        self.inner = bind_arm(choice, self.transport, self.params)
        self.inner.sync_enabled, self.inner.healing = enabled, healing
        self.choice = choice

    def _announce(self, choice: Choice) -> None:
        """Rank 0's one line for a decision that changed the arm (and for the first decision)."""
        if self.transport.rank == 0:
            print(announcement(self.steps, choice, self.reason, self.measured), flush=True)

    # -- checkpoints and logs -------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        """The decisions' state, without the arm's (read on this rank alone; module docstring): the
        arm in use, the steps counted, the step of the next decision (-1: none), the decisions and
        switches made, the last measurement, and the arms' observed costs (arm -> exposed seconds
        per step, the bandwidth then)."""
        return {
            "choice": self.choice.as_dict(),
            "steps": self.steps,
            "next_decision": self.next_decision,
            "decisions": self.decisions,
            "switches": self.switches,
            "measured": None if self.measured is None else self.measured.as_dict(),
            "observed": {arm: list(seen) for arm, seen in self.observed.items()},
        }

    def load_counters(self, saved: dict[str, Any]) -> None:
        """Put back what :meth:`counters` saved, all but the arm in use (``"measured"`` and
        ``"observed"`` may be missing: none)."""
        self.steps = int(saved["steps"])
        self.next_decision = int(saved["next_decision"])
        self.decisions = int(saved["decisions"])
        self.switches = int(saved["switches"])
        measured = saved.get("measured")
        self.measured = None if measured is None else Measurement.from_dict(measured)
        self.observed = {arm: (float(s), float(b)) for arm, (s, b) in saved.get("observed", {}).items()}

    def state_dict(self) -> dict[str, Any]:
        return {**self.counters(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or, with ``"healed"`` in ``state``, what a heal
        kept (collective over the healed run: :meth:`_load_healed`)."""
        if state.get("healed"):
            self._load_healed(state)
            return
        choice = Choice.from_dict(state["choice"])
        if choice != self.choice:
            self._bind(choice)
        self.inner.load_state_dict(state["inner"])
        self.load_counters(state)

    def _load_healed(self, state: dict[str, Any]) -> None:
        """Bind on the healed run what this survivor kept (``heal="shrink"``/``"replace"``;
        collective): the arm, the count of decisions and the step of the next decision the survivors
        agree on, and this rank's kept state of that arm where it kept it
        (:func:`~.heal.plan_after_heal`). What was observed of the arms' costs is dropped: the
        world size changed."""
        plan = plan_after_heal(self.transport, state, PROBE_STEPS)
        if plan.choice != self.choice:
            self._bind(plan.choice)
        if plan.arm_state is not None:
            self.inner.load_state_dict(plan.arm_state)
        self.load_counters(state)
        self.decisions, self.next_decision, self.observed = plan.decisions, plan.next_decision, {}
        self._announce_next = True

    def take_decision(self, counters: dict[str, Any]) -> None:
        """A survivor inside a decision that another completed takes its outcome (``counters``, the
        other's after it); the schedule agreed at the heal stays, the observations stay dropped."""
        next_decision = self.next_decision
        self.load_counters(counters)
        self.next_decision, self.observed = next_decision, {}

    def heal_state(self) -> dict[str, Any]:
        """What a survivor keeps (module docstring): its decisions' counters, and its arm's kept
        state (``"inner"``; this rank's own part of it under ``"local"``, which a rank let in does not
        take); inside a decision, the state that decision started from. Loaded, it makes the
        survivors agree (:meth:`_load_healed`)."""
        if self.deciding is not None:
            return self.deciding
        inner = dict(self.inner.heal_state())
        local = inner.pop("local", None)
        state = {**self.counters(), "healed": True, "deciding": False, "inner": inner}
        if local is not None:
            state["local"] = local
        return state

    def decision(self, optimizer: Optimizer) -> Operation[None]:
        """A decision (probe, dry runs, the agreement of their numbers, the switch) as one operation.
        Under ``heal``, before it: its state, the weights and the optimizer's float state are kept (a
        heal inside it keeps that state, so the survivors bind the arm it started from). Redone over
        the survivors from them (not when one rank is left: nothing to decide there, it keeps the arm
        it started from until ranks join again); a survivor inside it when another completed it
        takes the other's outcome: the decisions' state and, where it switched, the new arm's state,
        the weights and the optimizer state the switch left (replicated: a switch averages them)."""
        collective = [True]
        attempts = [0]
        started_from: dict[str, Any] = {}

        def start(auto: BoundAuto) -> tuple[dict[str, Any], list[Tensor], dict[tuple[int, str], Tensor]]:
            snapshot = {**auto.heal_state(), "deciding": True}
            started_from["choice"] = snapshot["choice"]
            weights = [p.detach().clone() for p in auto.params]
            moments = {key: t.detach().clone() for key, t in optimizer_float_state(auto.params, optimizer).items()}
            auto.deciding = snapshot  # what a heal keeps while it runs
            return snapshot, weights, moments

        def run(auto: BoundAuto) -> None:
            attempts[0] += 1
            if attempts[0] > 1 and auto.transport.size == 1:
                collective[0] = False  # redone on the one rank left: nothing to measure or exchange
                auto.deciding = None
                return
            auto.decide(optimizer)
            auto.deciding = None

        def put_back(auto: BoundAuto, started: Any) -> None:
            snapshot, weights, moments = started
            _write_back(auto.params, optimizer, weights, moments)
            auto.deciding = snapshot

        def result(auto: BoundAuto, _: None) -> tuple[dict[str, Any], Any, Any, Any]:
            if auto.choice == Choice.from_dict(started_from["choice"]):
                return auto.counters(), None, None, None
            state = optimizer_float_state(auto.params, optimizer)
            return (
                auto.counters(),
                auto.inner.heal_state(),
                [p.detach().cpu().clone() for p in auto.params],
                {key: t.detach().cpu().clone() for key, t in state.items()},
            )

        def take(auto: BoundAuto, sent: tuple[dict[str, Any], Any, Any, Any], _: Any) -> None:
            counters, inner, values, state = sent
            auto.take_decision(counters)
            if inner is None:
                return
            auto.inner.load_state_dict(inner)  # the arm the heal bound is the other's (.heal)
            _write_back(auto.params, optimizer, values, state)
            if isinstance(auto.inner, BoundDiLoCo):
                auto.inner.replicas.remember(optimizer)

        return Operation(
            "the mpi_auto decision",
            run,
            start=start,
            put_back=put_back,
            result=result,
            take=take,
            collective=lambda _auto, _started: collective[0],
        )

    def stats(self) -> dict[str, float]:
        mine = decision_stats(self.choice, self.switches, self.decisions, self._observed_share, self.measured)
        inner = {k: v for k, v in self.inner.stats().items() if k not in mine}
        return {**inner, **mine}


# -- what the rule says about its decisions (pure: the caller prints and logs) ----------------------
def _auto(execute: Execute) -> BoundAuto:
    """``mpi_auto`` as bound now (a heal binds it anew)."""
    auto = execute.bound
    assert isinstance(auto, BoundAuto)
    return auto


def _arm(auto: BoundAuto) -> BoundRule:
    """The arm ``auto`` trains with."""
    return auto.inner


def _write_back(
    params: Sequence[Tensor],
    optimizer: Optimizer,
    weights: Sequence[Tensor],
    float_state: dict[tuple[int, str], Tensor],
) -> None:
    """Copy ``weights`` into ``params`` and ``float_state`` (keyed as
    :func:`~lightning_mpi.rules.auto.arms.optimizer_float_state` keys it) into the optimizer's
    state, where it holds that entry."""
    mine = optimizer_float_state(params, optimizer)
    with torch.no_grad():
        for p, value in zip(params, weights, strict=True):
            p.copy_(value)
        for key, value in float_state.items():
            if key in mine:
                mine[key].copy_(value)


def announcement(steps: int, choice: Choice, reason: str, measured: Measurement | None) -> str:
    """The line announcing ``choice`` after ``steps`` steps, why, and what it was measured on."""
    link = measured.link if measured is not None else None
    seen = "" if link is None else f"; link {link.bandwidth * 8 / 1e6:.0f} Mbit/s, {link.latency * 1e3:.2f} ms"
    step = "" if measured is None else f", step {measured.step_seconds * 1e3:.0f} ms"
    return f"lightning_mpi: mpi_auto after step {steps}: {choice.describe()} ({reason}{seen}{step})"


def decision_stats(
    choice: Choice, switches: int, decisions: int, observed_share: float, measured: Measurement | None
) -> dict[str, float]:
    """The decisions' numbers: the arm in use and its settings, the switches and decisions made,
    the share of a step the arm in use was seen to expose, and the last measurement (where there
    was one)."""
    stats = {
        "arm": ARM_CODES[choice.arm],
        "wire_bits": WIRE_BITS.get(choice.wire, 0.0),
        "fragments": float(choice.fragments),
        "period": float(choice.period),
        "overlap_steps": float(choice.overlap_steps),
        "switches": float(switches),
        "decisions": float(decisions),
        "observed_exposed_share": observed_share,
    }
    if measured is not None:
        stats.update(
            step_seconds=measured.step_seconds,
            link_bandwidth=measured.link.bandwidth,
            link_latency=measured.link.latency,
        )
    return stats
