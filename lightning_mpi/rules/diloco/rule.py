"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023, arXiv:2311.08105): the algorithm and the rule (its math as pure functions: :mod:`.outer`).

Every rank trains its own replica θᵢ with the user's optimizer (the *inner* optimizer) for H
steps, then the ranks average their pseudo-gradients and an *outer* optimizer moves the global
weights θ_global that every rank holds identically (Douillard et al., Algorithm 1)::

    for each outer step:
        θᵢ ← θ_global                                  (every rank)
        H inner steps: θᵢ ← InnerOpt(θᵢ, ∇ℓ(θᵢ))       (the user's optimizer, no communication)
        Δ ← (1/W) Σᵢ (θ_global − θᵢ)                   (one exchange: the pseudo-gradient)
        θ_global ← OuterOpt(θ_global, Δ)               (SGD, Nesterov momentum)

With ``outer_lr = 1`` and no momentum the outer step is θ_global − Δ = mean(θᵢ): periodic model
averaging (:mod:`lightning_mpi.rules.averaging`). The outer optimizer is ``torch.optim.SGD``
(``nesterov=True`` whenever ``outer_momentum > 0``) over a flat copy of θ_global, with Δ as its
gradient. ``wire`` picks how Δ travels: fp32 (one Allreduce), or bf16, int8 or int4 through
ASA with error feedback (the unsent part of Δ joins the next outer step's Δ).

``wire="sparseloco"`` is SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706;
:mod:`lightning_mpi.comm.sparseloco`): each rank folds Δ into a decaying error-feedback
accumulator, ``e ← β·e + Δ``, sends the ``topk_per_chunk`` largest entries of each chunk of 4096
of ``e`` with 2-bit values (about 0.22 bits a value at 64), keeps the rest in ``e``, and the ranks
average what was sent. The paper's point is that this accumulator stands in for the outer
momentum, so the outer step is plain SGD, θ_global ← θ_global − α·mean Δ̂: ``outer_momentum``
resolves to 0 and refuses anything else (``ValueError``), and ``error_decay`` (β) belongs to this
wire alone. The accumulator is this rank's own state, like the dense wires' residuals: in
checkpoints under ``"ranks"``, through a heal under ``"local"``; it runs at every world size, one
rank included, since it is part of the algorithm and not only of the transport. Its defaults were
measured here (docs/convergence.md, "SparseLoCo's wire"): ``period`` 10 instead of 50 (an exchange
is 1/18 of the 4-bit wire's, so five times as many still send about a quarter of the bytes, and at
50 the global weights fell far behind the replicas: 8% higher held-out loss than the 4-bit wire on
the time-to-quality task at 300 steps), and the plain step at rate 1 (a rate of 1.5 did better on
that task and worse on two of the three models of ``benchmarks/compression.py``).

Defaults, cited: Douillard et al. use outer SGD with Nesterov momentum, ``outer_lr = 0.7``,
``outer_momentum = 0.9`` (ours from the second outer step: ``outer_warmup = 1`` makes the
first an average of the replicas, measured in ``benchmarks/outer_warmup.py``), and H = 500
inner steps of AdamW. H = 500 assumes runs of tens of thousands of steps; our runs are hundreds
to a few thousand, and 500 would leave them with a handful of outer steps or none. We take
``period = 50``: their ablation shows quality improving as H falls (at more communication), and
at 50 one exchange still costs about 2% of the steps' compute on a 1 Gbit/s link for a
17M-parameter model (0.1 s for Δ against about 10 s of steps).

State: θ_global, the outer momentum and the step count are the same on every rank; every
rank's local weights, inner-optimizer state and feedback residuals differ between exchanges, so
a checkpoint carries each rank's (:mod:`lightning_mpi.rules.diloco.state`), and a run resumed
mid-period retraces the uninterrupted one exactly.

At the end of training every rank is left with the replicas' mean: an exchange in flight is
completed, and the steps since each fragment's last exchange are exchanged, and both are applied
by *averaging*, θ_global ← θ_global − Δ = mean θᵢ, not by an outer step. (On SparseLoCo's wire
that last exchange is the wire's own, so θ_global moves by the mean of the sparse Δ̂ at rate 1:
one more plain outer step. Sending the accumulators densely at the end instead was measured far
worse, 4.90 against 2.84 nats/byte: an accumulator holds about 1/(1 − β) times a period's
progress, which the plain step at rate α is calibrated for only a fraction at a time.) The outer rate and
momentum are made for the Δ of a whole period applied in the middle of training; at the end,
Nesterov's step adds η·μ² = 0.57 times the momentum buffer however few steps the last period
held, and moves the weights away from where the replicas agree. On the time-to-quality task
(2 ranks, Streaming DiLoCo at its defaults; ``benchmarks/time_to_quality.py``), over end steps
100-160, an outer step at the end left the held-out loss 0.075 nats/byte above the replicas'
mean on average, up to 0.19 above it (step 157: 3.052 against 2.862) and at best 0.011 below:
what the end cost depended on where in the period the run stopped (docs/performance.md, "The
end of a DiLoCo run").

The running part, :class:`BoundDiLoCo`, also runs Streaming DiLoCo
(:mod:`lightning_mpi.rules.diloco.streaming`): several fragments on staggered schedules, each
exchange overlapped with ``overlap_steps`` inner steps, the result mixed in with ``mix_alpha``.
The options both share are :class:`OuterOptions`; the ``doc=`` of each is what the strategy
reference (docs/strategies.md) prints.

Healing the outer loop (``heal="shrink"``). When a rank dies, an outer exchange may be in flight
(Streaming DiLoCo's ``overlap_steps``, or a blocking one cut short). It cannot be completed: it was
started on a communicator with the dead rank. And it cannot simply be read back from the fragment,
since an exchange changes Δ and the feedback residual in place (ASA encodes with error feedback,
then averages into Δ). So, while the strategy heals (the rule's ``healing`` is set),
:class:`ExchangeSnapshots` copies both at every start; :func:`heal_fragments` saves that copy as
the fragment's ``"sent"``; :func:`load_healed` puts it back with status ``restart``, and the rule
starts it again over the survivors at its next hook. A rank that joins a healed run
(``heal="replace"``, :func:`join`) has no replica of its own: its weights start from θ_global and
its residuals at zero. It cannot join an exchange started without it, so the survivors let it in
only at a step with none in flight (:attr:`BoundDiLoCo.exchange_in_flight`).

What a survivor keeps (:meth:`BoundDiLoCo.heal_state`): the outer state (replicated: θ_global, the
outer momentum, the counters, the schedule, an arrived mean Δ), its own residuals, and an exchange
in flight as the Δ it started from. The hooks redo what a loss interrupted
(:meth:`~BoundDiLoCo.healable_after_step`, :meth:`~BoundDiLoCo.healable_train_end`): ``after_step``
from the state before it (the weights change only once an exchange completed); the final average
over the survivors from the state and weights before it, so that the survivors end bitwise identical
on the mean of *their* replicas (the lost rank's replica is left out of the mean). A survivor that
missed a completion takes the weights and the outer state of one that completed it (its own
residuals as before it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.codecs import get_codec
from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.sparseloco import CHUNK, SparseLoCoWire
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, optional, options_class
from lightning_mpi.rules.base import BoundLocalStepRule, Execute, Rule, redone_from_state
from lightning_mpi.rules.diloco.fragments import OuterFragment, Wire
from lightning_mpi.rules.diloco.outer import (
    apply_mean_delta_,
    averages_at,
    last_start,
    make_outer_optimizer,
    starts_at,
)
from lightning_mpi.rules.diloco.period import AUTO_PROBE_STEPS, check_period, choose_period
from lightning_mpi.rules.diloco.state import (
    ReplicaState,
    load_fragment,
    load_residuals,
    load_schedule,
    save_fragment,
    save_residuals,
    save_schedule,
)
from lightning_mpi.rules.diloco.warning import SlowExchangeWarning
from lightning_mpi.rules.link.probe import Measurement, StepClock

#: seconds between the progress thread's polls while an outer exchange is in flight
POLL_SECONDS = 2e-4
#: ``period``'s default on the dense wires
DENSE_PERIOD = 50
#: ``wire="sparseloco"``'s defaults: the period, the outer lr, entries per chunk of 4096, and β of
#: its error feedback (chosen on the benchmarks: docs/convergence.md, "SparseLoCo's wire")
SPARSE_PERIOD = 10
SPARSE_LR = 1.0
SPARSE_K = 64
ERROR_DECAY = 0.9


def number_of_entries(name: str, value: Any) -> int:
    """``topk_per_chunk``'s check: an integer in [1, 4096]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= CHUNK:
        raise ValueError(f"{name}={value!r} is out of range: it must be an integer in [1, {CHUNK}]")
    return value


# -- the rules --------------------------------------------------------------------------------------
@options_class
class OuterOptions(Rule):
    """The options DiLoCo and Streaming DiLoCo share: the outer step and how Δ travels."""

    period: int | Literal["auto"] | None = option(
        default=None,
        doc=f"H, inner steps between outer steps (≥ 1); None: {DENSE_PERIOD} (the paper's 500 is made for runs of "
        f'tens of thousands of steps), or {SPARSE_PERIOD} with `wire="sparseloco"` (its exchanges are 1/18 of the '
        '4-bit wire\'s: 5 times as many still send a quarter of the bytes). `"auto"`: the smallest period whose '
        "exchange, after the wire format, hides behind that many steps, from the compute time of a step and the link "
        "measured in the first steps (agreed by every rank; saved in checkpoints).",
        check=check_period,
    )
    outer_lr: float | None = option(
        default=None,
        doc="outer learning rate (> 0); None: the paper's 0.7, or 1 with `wire=\"sparseloco\"` (SparseLoCo's plain "
        "SGD step on the mean of the ranks' sparse Δ̂).",
        check=optional(number(0.0, math.inf, low_open=True, high_open=True)),
    )
    outer_momentum: float | None = option(
        default=None,
        doc='outer Nesterov momentum in [0, 1); None: the paper\'s 0.9, or 0 with `wire="sparseloco"` (whose '
        "error feedback replaces it; it takes no other). 0 is plain SGD, and `outer_lr=1, outer_momentum=0` is "
        "periodic model averaging.",
        check=optional(number(0.0, 1.0, high_open=True)),
    )
    wire: Literal["fp32", "bf16", "int8", "int4", "sparseloco"] = option(
        default="fp32",
        doc='how Δ travels: `"fp32"` (one Allreduce), `"bf16"`, `"int8"` or `"int4"` (ASA with error feedback), '
        'or `"sparseloco"` (SparseLoCo: the `topk_per_chunk` largest entries of every 4096 of each tensor, 12-bit '
        "indices and 2-bit values, one Allgather; error feedback decaying by `error_decay` in place of the outer "
        "momentum, so the outer step is plain SGD).",
    )
    outer_warmup: int = option(
        default=1,
        doc="the first outer steps of each fragment that average the replicas (θ_global ← mean θᵢ: outer lr 1, "
        "no momentum) before the Nesterov steps start; keeps a short run's first outer steps from overshooting.",
        check=integer(0),
    )
    topk_per_chunk: int = option(
        default=SPARSE_K,
        doc=f'`wire="sparseloco"`: the entries each chunk of 4096 sends, 1 to 4096 ({SPARSE_K}: '
        f"{SPARSE_K / 4096:.2%}, about {14 * SPARSE_K / 4096:.2f} bits per value with 12-bit indices and 2-bit "
        "values); other wires ignore it.",
        check=number_of_entries,
    )
    error_decay: float | None = option(
        default=None,
        doc=f'`wire="sparseloco"` only: β in [0, 1] of its error feedback, `e ← β·e + Δ` (None: {ERROR_DECAY}); '
        "the decayed accumulator is the outer momentum.",
        check=optional(number(0.0, 1.0)),
    )

    def check_together(self) -> None:
        if self.wire == "sparseloco":
            if self.outer_momentum:
                raise ValueError(
                    f"outer_momentum={self.outer_momentum!r} does not go with wire='sparseloco': its error feedback "
                    "(error_decay) replaces the outer momentum and the outer step is plain SGD; leave "
                    "outer_momentum=None (or 0)"
                )
        elif self.error_decay is not None:
            raise ValueError(
                f"error_decay={self.error_decay!r} needs wire='sparseloco' (the dense wires' error feedback keeps "
                f"everything it did not send); got wire={self.wire!r}"
            )

    @property
    def sparse(self) -> bool:
        """Whether Δ travels on SparseLoCo's wire (and the outer step is plain SGD)."""
        return self.wire == "sparseloco"

    def inner_period(self) -> int | Literal["auto"]:
        """``period``, ``None`` resolved for the wire."""
        if self.period is None:
            return SPARSE_PERIOD if self.sparse else DENSE_PERIOD
        return self.period

    def outer_step(self) -> tuple[float, float]:
        """The outer step's ``(lr, momentum)``, ``None`` resolved for the wire."""
        lr = self.outer_lr if self.outer_lr is not None else (SPARSE_LR if self.sparse else 0.7)
        momentum = self.outer_momentum if self.outer_momentum is not None else (0.0 if self.sparse else 0.9)
        return lr, momentum

    def make_wire(self) -> Wire:
        """The wire Δ travels on."""
        return SparseLoCoWire(self.topk_per_chunk) if self.sparse else get_codec(self.wire)

    def decay(self) -> float:
        """β of SparseLoCo's accumulator (1 elsewhere: not used)."""
        return (ERROR_DECAY if self.error_decay is None else self.error_decay) if self.sparse else 1.0


@options_class
class DiLoCoRule(OuterOptions):
    """DiLoCo (Douillard et al. 2023): ``period`` steps of your own optimizer (the inner optimizer),
    then an outer SGD step with Nesterov momentum on the averaged pseudo-gradient
    Δ = θ_global − θ_local, from which every rank continues. Registered as ``mpi_diloco``.
    """

    name = "diloco"

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundDiLoCo:
        return BoundDiLoCo(self, transport, params, groups=[list(params)], offsets_for=lambda period: [period])


class BoundDiLoCo(BoundLocalStepRule):
    """The running DiLoCo, for one fragment (DiLoCo) or several (Streaming DiLoCo).

    Args:
        rule: the hyperparameters (``period``, ``outer_lr``, ``outer_momentum``, ``wire``).
        transport: all ranks.
        params: the trainable parameters in model order.
        groups: the fragments, each a list of whole parameters, together ``params`` in order.
        offsets_for: the step of each fragment's first exchange for a period; it then exchanges
            every ``period``. With ``period="auto"`` the schedule starts after the steps that
            measure (:data:`AUTO_PROBE_STEPS` + 1), and its offsets are shifted by them.
        overlap_steps: τ, inner steps between the start of an exchange and its use (0: blocking).
        mix_alpha: α, how much of the local fragment survives the arriving global one.
    """

    def __init__(
        self,
        rule: Any,
        transport: Transport,
        params: Sequence[Tensor],
        groups: Sequence[Sequence[Tensor]],
        offsets_for: Callable[[int], list[int]],
        overlap_steps: int = 0,
        mix_alpha: float = 0.0,
    ) -> None:
        super().__init__(transport, params, rule.name)
        self.rule = rule
        self.offsets_for = offsets_for
        #: the period in use; None while ``period="auto"`` is still measuring
        period = rule.inner_period()
        self.period: int | None = None if period == "auto" else int(period)
        self.offsets: list[int] = [] if self.period is None else list(offsets_for(self.period))
        self.measured: Measurement | None = None
        self.clock = StepClock()
        self.overlap_steps = overlap_steps
        self.mix_alpha = mix_alpha
        wire, decay = rule.make_wire(), rule.decay()
        self.fragments = [OuterFragment(group, transport.size, wire, decay) for group in groups]
        self.outer = make_outer_optimizer([f.theta_global for f in self.fragments], *rule.outer_step())
        self.replicas = ReplicaState(transport, self.params)
        # A private communicator: an exchange in flight must not interleave with other collectives.
        self.team = transport.dup() if transport.size > 1 else transport
        self.progress = ExchangeScheduler(transport.timeout, transport.rank, transport.size, comm=self.team.comm)
        self.driver: ProgressThread | None = None
        if (overlap_steps > 0 or (self.period is None and len(groups) > 1)) and transport.size > 1:
            # MPICH moves a non-blocking exchange only inside MPI calls: poll while one is in flight,
            # and stop once it has arrived (waking for nothing costs the training thread the GIL).
            self.driver = ProgressThread(self._drive, POLL_SECONDS, f"{rule.name} (overlap_steps > 0)", running=False)
        self.steps = 0
        self.outer_steps = 0
        self.peak_exchange_bytes = 0
        #: with ``healing`` set (the strategy heals): each exchange keeps the Δ and residual it
        #: started from, so that one in flight when a rank dies can be started again (heal_state)
        self.snapshots = ExchangeSnapshots()
        #: a blocking exchange that costs more than the steps between two: warns once, rank 0
        self.slow_warning = SlowExchangeWarning(f"mpi_{rule.name}", transport.rank, rule.wire)
        self._loaded = False
        self._seconds = 0.0
        self._bytes = 0

    def _drive(self) -> None:
        """The progress thread's poll: move the exchange in flight; pause once none is."""
        self.progress.try_poll(on_idle=self._pause_driver)

    def _pause_driver(self) -> None:
        if self.driver is not None:
            self.driver.pause()

    # -- hooks --------------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        if not self._loaded:
            for fragment in self.fragments:
                fragment.adopt_local()

    def before_step(self, optimizer: Optimizer) -> bool:
        """Load a restored inner-optimizer state, move an exchange in flight, then the local guard."""
        self._restart()
        self.replicas.apply_pending(optimizer)
        self.clock.pause()
        if self.driver is None and any(f.status == "running" for f in self.fragments):
            self.progress.poll()
        return super().before_step(optimizer)

    def _advance(self) -> None:
        """Count one inner step; use the exchanges due now, then start the ones scheduled now."""
        self._restart()
        self.steps += 1
        self._seconds, self._bytes = 0.0, 0
        start = time.perf_counter()
        for index, fragment in enumerate(self.fragments):
            if fragment.status != "idle" and fragment.due <= self.steps:
                self._finish(index, self.mix_alpha)
        if self.period is None:
            if self.steps == AUTO_PROBE_STEPS + 1:
                self._choose_period()
        else:
            for index, offset in enumerate(self.offsets):
                if starts_at(self.steps, offset, self.period):
                    self._start(index)
                    if self.overlap_steps == 0:
                        self._finish(index, self.mix_alpha)
        self._seconds = time.perf_counter() - start
        if self._bytes and self.overlap_steps == 0 and self.period is not None:  # no bytes on one rank
            self.slow_warning.check(self._seconds, self.clock.seconds(), self.period)
        self.clock.resume()

    def _choose_period(self) -> None:
        """``period="auto"``: measure the step and the link, agree with the other ranks, fix the
        schedule from here (:func:`~.period.choose_period`)."""
        step = self.clock.seconds() or 1e-3
        self.measured, period, tau = choose_period(self.fragments, self.team, self.progress, step, self.overlap_steps)
        self._set_schedule(period, tau, start=self.steps)

    def reschedule(self, period: int, overlap_steps: int) -> bool:
        """Train on with ``period`` and τ = ``overlap_steps`` exactly as if bound with them, where that
        is possible: before the first exchange has started (the schedule counts from step 0), with a
        fixed period, τ < period // fragments, and the progress thread that τ > 0 needs on several
        ranks. Returns whether it did (else nothing changed: bind anew)."""
        fragments = len(self.fragments)
        started = self.outer_steps > 0 or any(f.started or f.status != "idle" for f in self.fragments)
        needs_driver = overlap_steps > 0 and self.transport.size > 1 and self.driver is None
        if started or self.period is None or needs_driver or not 0 <= overlap_steps < period // fragments:
            return False
        if self.steps >= min(self.offsets_for(period)):  # its first exchange would be behind us
            return False
        self._set_schedule(period, overlap_steps, start=0)
        return True

    def _set_schedule(self, period: int, overlap_steps: int, start: int) -> None:
        self.period, self.overlap_steps = period, overlap_steps
        self.offsets = [start + offset for offset in self.offsets_for(period)]

    def outer_count(self, index: int) -> int:
        """Which outer step (1-based) of fragment ``index`` its last started exchange makes."""
        if self.period is None:
            return 1
        fragment, offset = self.fragments[index], self.offsets[index]
        return (fragment.started - offset) // self.period + 1 if fragment.started >= offset else 1

    def _start(self, index: int) -> None:
        """Δ of fragment ``index`` from this rank's weights, and the start of its averaging."""
        fragment = self.fragments[index]
        torch.sub(fragment.theta_global, fragment.local.pull(), out=fragment.delta)
        fragment.status, fragment.started, fragment.due = "running", self.steps, self.steps + self.overlap_steps
        if self.healing:  # what the exchange starts from (it changes Δ and the residual in place)
            self.snapshots.keep(index, fragment)
        self.progress.start(fragment.mean_steps(self.team))
        if self.driver is not None:
            self.driver.start()
        self._bytes += fragment.bytes_per_exchange
        self.peak_exchange_bytes = max(self.peak_exchange_bytes, fragment.bytes_per_exchange)

    def _wait(self) -> None:
        """Complete every running exchange (their means land in the fragments' ``delta``)."""
        self._restart()
        if any(f.status == "running" for f in self.fragments):
            self.progress.wait_all()
            if self.driver is not None:
                self.driver.pause()
            for fragment in self.fragments:
                if fragment.status == "running":
                    fragment.status = "arrived"
            self.snapshots.clear()

    def _restart(self) -> None:
        """Start again, on this binding's communicator, the exchanges that were in flight when a
        rank died (:meth:`heal_state`), from the Δ and residual they had started from."""
        for fragment in self.fragments:
            if fragment.status == "restart":
                fragment.status = "running"
                self.progress.start(fragment.mean_steps(self.team))
                if self.driver is not None:
                    self.driver.start()

    def _finish(self, index: int, alpha: float, average: bool = False) -> None:
        """The outer step of fragment ``index`` with its mean Δ, then mix it into the local weights
        (``alpha`` 1: leave them). ``average``: θ_global ← θ_global − Δ (the replicas' mean when Δ
        was taken) instead of the outer step, whatever its count."""
        self._wait()
        fragment = self.fragments[index]
        average = average or averages_at(self.outer_count(index), self.rule.outer_warmup)  # no momentum yet
        apply_mean_delta_(self.outer, fragment.theta_global, fragment.delta, average, fragment.local, alpha)
        fragment.status = "idle"
        self.outer_steps += 1

    def on_train_end(self) -> None:
        """Leave the replicas' mean of the last step in θ_global and the weights on every rank: what
        is in flight is completed and the steps since each fragment's exchange are folded in, both
        by averaging (not an outer step: module docstring)."""
        for index, fragment in enumerate(self.fragments):
            if fragment.status != "idle":  # the local weights stay: their steps since its start are folded in next
                self._finish(index, 1.0, average=True)
        for index, fragment in enumerate(self.fragments):
            # period None: ended while period="auto" was still measuring, so one exchange at the end
            since = 0 if self.period is None else last_start(self.steps, self.offsets[index], self.period)
            if since < self.steps:
                self._start(index)
                self._finish(index, 0.0, average=True)
            fragment.local.push(fragment.theta_global)

    # -- healing (module docstring) -------------------------------------------------------------------
    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        execute(
            redone_from_state(
                "the outer exchange",
                lambda bound: bound.after_step(optimizer),
                moving=lambda bound: list(bound.params),
                exchanged=lambda bound, before: bound.outer_steps != before["outer_steps"],
                restore=False,  # the weights change only once an exchange completed
            )
        )

    def healable_train_end(self, execute: Execute) -> None:
        execute(
            redone_from_state(
                "the final average",
                lambda bound: bound.on_train_end(),
                moving=lambda bound: list(bound.params),
                # every rank runs the same schedule: each averaged fragment is one outer step, and at
                # W = 1 nothing went over the wire
                exchanged=lambda bound, before: bound.transport.size > 1 and bound.outer_steps != before["outer_steps"],
                # an interrupted average may have averaged and pushed some fragments into the weights
                restore=True,
            )
        )

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        if self.team is not self.transport:
            self.team.free()
            self.team = self.transport

    # -- checkpoints (the format and its parts: :mod:`.state`) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Collective: completes an exchange in flight (its mean Δ is saved and used at its due
        step after a resume), and gathers every rank's local weights, optimizer state and residuals."""
        self._wait()
        fragments = [save_fragment(fragment, self.outer) for fragment in self.fragments]
        residuals = save_residuals(self.fragments)
        ranks = self.replicas.gather()
        if self.transport.size > 1:
            extras = self.transport.allgather_object(residuals)
            ranks = [{**r, **e} for r, e in zip(ranks, extras, strict=True)]
        else:
            ranks[0].update(residuals)
        return {
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "fragments": fragments,
            "world_size": self.transport.size,
            "ranks": ranks,
            "schedule": self._schedule(),
        }

    def heal_state(self) -> dict[str, Any]:
        """What this rank carries into a healed run (``heal="shrink"``; no collective: the others may
        be gone). The outer state is replicated, so every survivor holds it whole: θ_global, the
        outer momentum, the counters and the fragments' schedule; a mean Δ that arrived is kept;
        an exchange in flight is kept as the Δ (and residual) it started from, and started again
        over the survivors. This rank's own: its feedback residuals (owned-chunk residuals are cut
        anew for the new world size and start at zero) and, in the module, its local weights."""
        fragments, residuals = heal_fragments(self.fragments, self.outer, self.snapshots, self.rule.name)
        return {
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "fragments": fragments,
            "world_size": self.transport.size,
            "local": {"residuals": residuals, "skipped_steps": self.guard.skipped_steps},
            "schedule": self._schedule(),
        }

    def _schedule(self) -> dict[str, Any]:
        return save_schedule(self.period, self.overlap_steps, self.offsets, self.measured)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(
                f"lightning_mpi: the checkpoint holds {len(state['fragments'])} DiLoCo fragments, this run has "
                f"{len(self.fragments)}; resume with the fragments the checkpoint was written with"
            )
        self.steps = int(state["steps"])
        self.outer_steps = int(state.get("outer_steps", 0))
        chosen = load_schedule(state.get("schedule"))
        if chosen is not None:  # the period the saved run chose
            self.period, self.overlap_steps, self.offsets, self.measured = chosen
        for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
            load_fragment(fragment, self.outer, saved)
        self.snapshots.clear()
        if "local" in state:  # a heal: this rank's own part; its local weights are the module's
            self._load_healed(state)
            return
        if "ranks" not in state:  # a rank that joins a healed run (heal="replace"): none of its own
            self._load_joined(state)
            return
        same_world = self.replicas.restore(state["ranks"], int(state["world_size"]))
        for index, fragment in enumerate(self.fragments):
            if not same_world:  # residuals and local weights of other ranks do not map onto these
                fragment.local.push(fragment.theta_global)
                continue
            load_residuals(fragment, index, state["ranks"][self.transport.rank])
        self._loaded = True

    def _load_healed(self, state: dict[str, Any]) -> None:
        """The rest of :meth:`heal_state`: this rank's residuals, and the exchanges to start again
        (:func:`load_healed`)."""
        mine = state["local"]
        self.guard.skipped_steps = int(mine.get("skipped_steps", 0))
        load_healed(self.fragments, state["fragments"], mine["residuals"], self.snapshots)
        self._loaded = True

    def _load_joined(self, state: dict[str, Any]) -> None:
        """A new rank let into a healed run (``heal="replace"``) with the survivors' outer state
        (:meth:`heal_state` without this rank's part): it has no replica of its own, so its local
        weights start from θ_global (as every rank's do after an outer step, and as a resume at
        another world size does), its residuals at zero. The survivors let it in only while no
        exchange is in flight (:attr:`exchange_in_flight`): it could not join one started without it."""
        join(self.fragments, state["fragments"])
        self._loaded = True

    @property
    def exchange_in_flight(self) -> bool:
        """Whether an outer exchange was started and has not arrived yet (Streaming DiLoCo's
        ``overlap_steps``; one started again after a heal included)."""
        return any(f.status in ("running", "restart") for f in self.fragments)

    def stats(self) -> dict[str, float]:
        chosen = {}
        if self.measured is not None:
            chosen = {
                "period": float(self.period or 0),
                "overlap_steps": float(self.overlap_steps),
                "step_seconds": self.measured.step_seconds,
                "link_bandwidth": self.measured.link.bandwidth,
                "link_latency": self.measured.link.latency,
            }
        return {
            **chosen,
            "exchange_seconds": self._seconds,
            "wire_bytes": float(self._bytes),
            "peak_exchange_bytes": float(self.peak_exchange_bytes),
            "bytes_per_exchange": float(max(f.bytes_per_exchange for f in self.fragments)),
            "outer_steps": float(self.outer_steps),
            "skipped_steps": float(self.guard.skipped_steps),
        }


# -- healing the outer loop (module docstring) ------------------------------------------------------
class ExchangeSnapshots:
    """The Δ and residual each fragment's exchange in flight started from, by fragment index."""

    def __init__(self) -> None:
        self._started_from: dict[int, tuple[Tensor, Tensor | None]] = {}

    def keep(self, index: int, fragment: OuterFragment) -> None:
        """Copy what fragment ``index``'s exchange starts from (call before it starts)."""
        residual = None if fragment.residual is None else fragment.residual.clone()
        self._started_from[index] = (fragment.delta.clone(), residual)

    def clear(self) -> None:
        """Forget them all: no exchange is in flight any more."""
        self._started_from.clear()

    def started_from(self, index: int, rule_name: str) -> tuple[Tensor, Tensor | None]:
        """What fragment ``index``'s exchange in flight started from.

        Raises:
            LookupError: none was kept (the exchange started while the rule was not healing).
        """
        if index not in self._started_from:
            raise LookupError(f"{rule_name}: an exchange was in flight and its start was not kept (healing off)")
        return self._started_from[index]


def heal_fragments(
    fragments: Sequence[OuterFragment], outer: Optimizer, snapshots: ExchangeSnapshots, rule_name: str
) -> tuple[list[dict[str, Any]], list[Tensor | None]]:
    """The replicated entries of every fragment (an exchange in flight as the Δ it started from,
    under ``"sent"``) and this rank's residuals, unpadded: the residual an exchange in flight
    started from, since that exchange will run again from it."""
    entries = []
    residuals = []
    for index, fragment in enumerate(fragments):
        running = fragment.status in ("running", "restart")
        delta, residual = snapshots.started_from(index, rule_name) if running else (fragment.delta, fragment.residual)
        entries.append(save_fragment(fragment, outer, healing=True, sent=delta if running else None))
        residuals.append(None if residual is None else residual[: fragment.numel].clone())
    return entries, residuals


def load_healed(
    fragments: Sequence[OuterFragment],
    saved: Sequence[dict[str, Any]],
    residuals: Sequence[Tensor | None],
    snapshots: ExchangeSnapshots,
) -> None:
    """The rest of a heal, after the replicated entries are loaded: this rank's residuals (the
    owned-chunk ones start at zero: the chunks are cut anew for the new world size), and each
    exchange that was in flight, back in Δ with status ``restart`` (started again by the rule's
    next hook, so that one exchange is in flight at a time) and kept again in ``snapshots``, in
    case another rank dies before it arrives."""
    for index, (fragment, entry) in enumerate(zip(fragments, saved, strict=True)):
        kept = residuals[index]
        if fragment.residual is not None:
            fragment.residual.zero_()
            if kept is not None:
                fragment.residual[: fragment.numel].copy_(kept)
        if fragment.owner_residual is not None:
            fragment.owner_residual.zero_()
        if entry.get("sent") is not None:
            fragment.delta.zero_()
            fragment.delta[: fragment.numel].copy_(entry["sent"])
            fragment.status = "restart"
            snapshots.keep(index, fragment)


def join(fragments: Sequence[OuterFragment], saved: Sequence[dict[str, Any]]) -> None:
    """A new rank's start in a healed run, from the survivors' replicated entries: local weights
    from θ_global (as every rank's after an outer step), residuals at zero.

    Raises:
        ValueError: an exchange was in flight (the survivors must let it in at a step with none).
    """
    if any(entry.get("sent") is not None for entry in saved):
        raise ValueError(
            "lightning_mpi: a new rank cannot join while a DiLoCo exchange is in flight; the survivors let "
            "it in at a step with none (lightning_mpi.strategies.replacement)"
        )
    for fragment in fragments:
        if fragment.residual is not None:
            fragment.residual.zero_()
        if fragment.owner_residual is not None:
            fragment.owner_residual.zero_()
        fragment.local.push(fragment.theta_global)
