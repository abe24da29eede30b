"""Two levels, the way clusters are built: every step inside a host, low communication between hosts.

The ranks of a host form one *replica* (:mod:`.layout`: the host's ranks, or ``group_size`` of
them). Inside a replica the ranks average their gradients every step, over shared memory, with the
synchronous rule (:class:`~lightning_mpi.rules.sync.SyncRule`, bound to the replica's
communicator: ASA with an fp32, fp16 or bf16 wire, or one Allreduce), so a replica of g ranks with
batch B follows one process with batch g·B. Across hosts the replicas run (Streaming) DiLoCo
(:mod:`lightning_mpi.rules.diloco`'s math, :mod:`.outer`'s functions): every ``period`` steps each
fragment's pseudo-gradient Δ = θ_global − θ_replica is averaged over the replicas and an outer
Nesterov step moves θ_global, which every rank holds::

    every step, inside replica r:   g ← mean of its ranks' gradients;  θ_r ← InnerOpt(θ_r, g)
    after step t = o_p + kH, fragment p:
        Δ_p ← (1/R) Σ_r (θ_global,p − θ_r,p)      rank i of every replica averages piece i of Δ_p,
                                                   then the replica Allgathers the pieces
    after step t + τ:
        θ_global,p ← OuterOpt(θ_global,p, Δ_p);   θ_r,p ← α·θ_r,p + (1 − α)·θ_global,p

The members of a replica hold the same Δ, so the replica sends it across once, cut into pieces
over its members (:mod:`.pieces`): each rank sends 1/g of its replica's cross-host bytes, over its
own link, and a flat Streaming DiLoCo over the same ranks would send g times as many across (every
rank its whole Δ). ``fragments=1, overlap_steps=0, mix_alpha=0`` is DiLoCo between replicas;
``outer_lr=1, outer_momentum=0`` with that is periodic model averaging of the replicas. With one
rank per host (``group_size=1``) the rule is flat Streaming DiLoCo, step for step.

``wire="sparseloco"`` sends the pieces across on SparseLoCo's wire, as ``mpi_diloco`` and
``mpi_streaming_diloco`` can (:mod:`lightning_mpi.comm.sparseloco`): each carrier folds its piece of
Δ into a decaying error-feedback accumulator, ``e ← β·e + Δ`` (β: ``error_decay``), and only the
``topk_per_chunk`` largest entries of each chunk of 4096 of ``e`` cross, with 2-bit values, in one
Allgather over the piece's carriers; the replica's Allgather then hands every member the dense mean.
The accumulator stands in for the outer momentum, so the outer step is plain SGD and the options
resolve as :class:`~lightning_mpi.rules.diloco.rule.OuterOptions` does (``period`` 10, ``outer_lr``
1, ``outer_momentum`` 0 and no other; dense wires: 50, 0.7, 0.9). The accumulator is the carrier's
own, like the dense wires' residuals: it runs on one replica too (part of the algorithm), a
checkpoint keeps it per rank and restores it at the same layout, and a heal starts it at zero (the
pieces are cut anew). A piece's chunks run over its entries as one section, not tensor by tensor as
flat Streaming DiLoCo's do, so with ``group_size=1`` this wire is not ``mpi_streaming_diloco``'s
step for step (the dense wires are).

``inner_exchange="zero"`` runs ZeRO inside each replica (:mod:`lightning_mpi.rules.zero`, bound to the
replica's communicator): the replica's optimizer state and reduced gradients are sharded over its
ranks, the bytes inside the host are ASA's, and the replica's weights are whole on every member after
each step, so the outer loop reads and writes them as with ASA (fp32 inside: ZeRO's 16-bit wire keeps
master weights that an outer step would bypass). The run holds one sharded optimizer per replica;
checkpoints are sharded, each shard tagged with its replica (:mod:`.shards`). It does not heal (the
strategy's ``heal`` is refused, naming the fix).

The end of training folds the steps since each fragment's last exchange in by averaging (θ_global
← θ_global − Δ: the replicas' mean, no outer step), as DiLoCo's end does, and leaves it in every
rank's weights.

Healing (``heal="shrink"``). A lost rank shrinks its replica: the survivors bind again over the
new layout, where the replica's remaining members carry the lost member's pieces; a lost host
(every rank of a replica) leaves the other replicas going on (set ``min_ranks`` to allow it: by
default more than half of the ranks must survive). What a survivor keeps (:meth:`BoundHybrid.heal_state`):
the outer state (θ_global, the outer momentum, the counters: the same on every rank), an exchange
in flight as the Δ it started from (started again over the new layout), and its own count of
gradient exchanges inside its replica, with the last one's result. The residuals of the pieces
start at zero (the pieces are cut anew). The hooks heal as operations:

- the gradient exchange inside the replica (``before_step``) is redone over the replica's
  survivors with this rank's own gradients put back. It involves one replica only, so it is not
  reconciled across replicas (the replicas run apart between outer exchanges); inside a replica,
  the survivors compare their counts when they bind again, and one that missed the completion of
  an exchange that a replica-mate completed takes its result (gradients) from it. Survivors of a
  replica more than one exchange apart cannot be brought in step: ``RankFailedError``.
- the outer exchange (``after_step``, and ``before_step`` on a step that the inner exchange
  rejected) is redone from the state and weights before it, or its result taken from a survivor
  that completed it; every member of every replica takes part in each one (its pieces or the
  replica's Allgather), so the survivors meet there.
- the final average (``on_train_end``): the same.

``heal="replace"``: a new rank binds with the survivors' outer state. Its key decides its replica
(:func:`~.layout.host_key`): with ``group_size`` a spawned process forms a replica of its own,
whose weights start from θ_global (as flat DiLoCo's new ranks do); on a host whose replica has
survivors it joins them and takes their weights and inner-optimizer state from the first of them.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.engine import ExchangeScheduler
from lightning_mpi.comm.errors import RankFailedError
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, optional, options_class
from lightning_mpi.rules.base import (
    BoundRule,
    Execute,
    Operation,
    OptimizerShards,
    Rule,
    gradient_exchange,
    redone_from_state,
)
from lightning_mpi.rules.diloco.outer import (
    apply_mean_delta_,
    averages_at,
    last_start,
    make_outer_optimizer,
    starts_at,
)
from lightning_mpi.rules.diloco.rule import DENSE_PERIOD, SPARSE_PERIOD, OuterOptions
from lightning_mpi.rules.diloco.state import load_optimizer_state, optimizer_state_of
from lightning_mpi.rules.diloco.streaming import check_schedule, fragment_offsets, split_fragments
from lightning_mpi.rules.hybrid.layout import Layout, build_layout
from lightning_mpi.rules.hybrid.pieces import ReplicaFragment
from lightning_mpi.rules.hybrid.shards import ReplicaShards
from lightning_mpi.rules.hybrid.state import load_fragment, load_local_weights, local_weights, save_fragment
from lightning_mpi.rules.sync import SyncRule
from lightning_mpi.rules.zero import ZeroRule

#: seconds between the progress thread's polls while an outer exchange is in flight
POLL_SECONDS = 2e-4


@options_class
class HybridRule(OuterOptions):
    """Two levels: the ranks of a host (or of ``group_size``) form one replica that averages gradients
    every step (ASA over shared memory), and the replicas run Streaming DiLoCo across hosts, each rank
    carrying its own piece of its replica's outer exchange. Registered as ``mpi_hybrid``.
    """

    name = "hybrid"

    group_size: int | None = option(
        default=None,
        doc="ranks per replica (≥ 1): None, the ranks of each host (split by host name; the environment variable "
        "`LIGHTNING_MPI_RANKS_PER_NODE=k` groups k launch ranks instead, to fake hosts on one machine); k: the "
        "launch ranks k·i … k·i + k − 1 form replica i. A heal keeps every process in its replica.",
        check=optional(integer(1)),
    )
    inner_exchange: Literal["asa", "allreduce", "zero"] = option(
        default="asa",
        doc='how a replica averages gradients every step: `"asa"` (Alltoall, fp32 sum, Allgather), `"allreduce"`, '
        'or `"zero"` (ZeRO stages 1 and 2 inside the replica, as `mpi_zero`: its optimizer state and reduced '
        "gradients sharded over the replica's ranks; checkpoints are sharded, one set of shards per replica).",
    )
    inner_wire: Literal["fp32", "fp16", "bf16"] = option(
        default="fp32",
        doc='the wire inside a replica (shared memory): 16-bit formats need `inner_exchange="asa"`, which sums in '
        "fp32.",
    )
    period: int | None = option(
        default=None,
        doc=f"H, steps between a fragment's outer exchanges across replicas (≥ 1); None: {DENSE_PERIOD}, or "
        f'{SPARSE_PERIOD} with `wire="sparseloco"` (as `mpi_streaming_diloco`).',
        check=optional(integer(1)),
    )
    fragments: int = option(
        default=4,
        doc="P, the fragments exchanged in turn, one every period/P steps (≥ 1, ≤ period); a model with fewer "
        "trainable tensors runs with one fragment per tensor (and a warning). 1: DiLoCo across replicas.",
        check=integer(1),
    )
    overlap_steps: int = option(
        default=1,
        doc="τ, steps between the start of a fragment's exchange and its use (0: blocking); below period // fragments.",
        check=integer(0),
    )
    mix_alpha: float = option(
        default=0.5,
        doc="α in [0, 1): the arriving fragment sets θ_replica ← α·θ_replica + (1 − α)·θ_global.",
        check=number(0.0, 1.0, high_open=True),
    )
    wire: Literal["fp32", "bf16", "int8", "int4", "sparseloco"] = option(
        default="int4",
        doc='how each piece of Δ crosses between replicas: `"fp32"` (one Allreduce), `"bf16"`, `"int8"` or `"int4"` '
        '(ASA with error feedback), or `"sparseloco"` (SparseLoCo: the `topk_per_chunk` largest entries of every '
        "4096 of the piece, 12-bit indices and 2-bit values, one Allgather; error feedback decaying by "
        "`error_decay` in place of the outer momentum, so the outer step is plain SGD).",
    )
    outer_warmup: int = option(
        default=1,
        doc="the first outer steps of each fragment that average the replicas (θ_global ← mean θ_replica) before "
        "the Nesterov steps start.",
        check=integer(0),
    )

    def check_together(self) -> None:
        super().check_together()  # the outer step against the wire (OuterOptions)
        if self.inner_wire != "fp32" and self.inner_exchange == "allreduce":
            raise ValueError(
                f"inner_wire={self.inner_wire!r} needs inner_exchange='asa' (ASA sums 16-bit chunks in fp32); "
                f"got inner_exchange={self.inner_exchange!r}"
            )
        if self.inner_wire != "fp32" and self.inner_exchange == "zero":
            raise ValueError(
                f"inner_wire={self.inner_wire!r} is not offered with inner_exchange='zero': ZeRO's 16-bit wire keeps "
                "fp32 master weights on each shard's owner, which the outer steps across replicas would bypass. Use "
                "inner_wire='fp32' with ZeRO, or inner_exchange='asa' with a 16-bit wire"
            )
        check_schedule(self.fragments, self.overlap_steps, self.inner_period())

    def inner_period(self) -> int:
        """``period``, ``None`` resolved for the wire (:meth:`OuterOptions.inner_period`; no ``"auto"`` here)."""
        period = super().inner_period()
        if period == "auto":  # not an accepted value of this rule's period
            raise ValueError('period="auto" is not supported by mpi_hybrid: give an integer >= 1 or None')
        return period

    def inner_rule(self) -> Rule:
        """The every-step rule inside a replica."""
        if self.inner_exchange == "zero":
            return ZeroRule()
        return SyncRule(exchange=self.inner_exchange, wire=self.inner_wire)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundHybrid:
        return BoundHybrid(self, transport, params)


def fragment_groups(params: Sequence[Tensor], fragments: int) -> list[list[Tensor]]:
    """``params`` cut into ``fragments`` contiguous groups of whole tensors (Streaming DiLoCo's
    :func:`~lightning_mpi.rules.diloco.streaming.split_fragments`); fewer tensors than fragments give
    one group per tensor, with a warning."""
    params = list(params)
    if 0 < len(params) < fragments:
        warnings.warn(
            f"lightning_mpi: fragments={fragments} is more than the model's {len(params)} trainable tensors; "
            f"mpi_hybrid runs with {len(params)} fragments (one tensor each).",
            RuntimeWarning,
            stacklevel=3,
        )
        fragments = len(params)
    groups: list[list[Tensor]] = [[] for _ in range(fragments)]
    for param, group in zip(params, split_fragments([p.numel() for p in params], fragments), strict=True):
        groups[group].append(param)
    return groups


class BoundHybrid(BoundRule):
    """The running two-level rule (module docstring).

    Attributes:
        layout: this rank's replica and pieces (:class:`~.layout.Layout`).
        inner: the every-step rule bound to the replica's communicator.
        fragments: the outer loop's fragments (:class:`~.pieces.ReplicaFragment`).
    """

    def __init__(self, rule: HybridRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        self.rule = rule
        self.layout: Layout = build_layout(transport, rule.group_size)
        self.inner = rule.inner_rule().bind(self.layout.inner, self.params)
        inner_shards = self.inner.optimizer_shards  # ZeRO inside the replica (inner_exchange="zero")
        self._shards = None if inner_shards is None else ReplicaShards(inner_shards, self.layout)
        groups = fragment_groups(self.params, rule.fragments)
        wire, decay = rule.make_wire(), rule.decay()
        self.fragments = [ReplicaFragment(group, self.layout, wire, decay) for group in groups]
        self.period = rule.inner_period()
        self.offsets = fragment_offsets(self.period, len(groups))
        self.outer = make_outer_optimizer([f.theta_global for f in self.fragments], *rule.outer_step())
        self.progress = ExchangeScheduler(
            transport.timeout,
            transport.rank,
            transport.size,
            watch=transport.watch,
            on_driver_error=transport.report_thread_failure,
            comm=transport.comm,
        )
        self.driver: ProgressThread | None = None
        #: whether an outer exchange goes over the wire: across replicas, or SparseLoCo's rows Allgathered
        #: inside one replica of several ranks (its wire runs on one replica too: :mod:`.pieces`)
        self.outer_communicates = self.layout.replicas > 1 or (rule.sparse and self.layout.size > 1)
        if rule.overlap_steps > 0 and self.outer_communicates:
            # MPICH moves a non-blocking exchange only inside MPI calls: poll while one is in flight,
            # and stop once it has arrived (waking for nothing costs the training thread the GIL).
            self.driver = ProgressThread(
                self._drive,
                POLL_SECONDS,
                "mpi_hybrid (overlap_steps > 0)",
                running=False,
                on_error=transport.report_thread_failure,
            )
        self.steps = 0  # updating steps (the outer schedule's clock, the same on every rank)
        self.outer_steps = 0
        #: gradient exchanges completed inside the replica (compared inside a replica after a heal)
        self.inner_steps = 0
        #: under ``healing``: the last gradient exchange's result, ``(accepted, gradients)``, for a
        #: replica-mate that missed its completion
        self.last_inner: tuple[bool, list[Tensor | None]] | None = None
        #: under ``healing``: the Δ each exchange in flight started from, by fragment
        self.snapshots: dict[int, Tensor] = {}
        self._optimizer: Optimizer | None = None
        self._pending_optimizer: list[dict[str, Any]] | None = None  # a restored inner-optimizer state
        self._advanced = False  # this step was advanced in before_step (its exchange rejected it)
        self._loaded = False
        self._healed = False  # bound by a heal: compare counts inside the replica at on_train_start
        self._joined = False  # a new rank (heal="replace"): it takes its replica's weights, if any
        self._take_inner: tuple[bool, list[Tensor | None]] | None = None
        self._send_optimizer: bool | None = None  # after a let-in: whether this replica hands its optimizer on
        self._seconds = 0.0
        self._bytes = 0

    _healing = False

    # -- what the strategy sets on the rule, handed to the rule inside ------------------------------
    @property  # an attribute of the contract (BoundRule.sync_enabled), forwarded to the inner rule
    def sync_enabled(self) -> bool:
        return self.inner.sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        self.inner.sync_enabled = value

    @property  # an attribute of the contract (BoundRule.healing), set by the strategy right after binding
    def healing(self) -> bool:
        return self._healing

    @healing.setter
    def healing(self, value: bool) -> None:
        if value and self._shards is not None:
            raise ValueError(
                "mpi_hybrid does not heal with inner_exchange='zero' yet: a lost rank's shard of its replica's "
                "optimizer would be lost. Use inner_exchange='asa' (or 'allreduce') with heal, or heal=None"
            )
        self._healing = value

    @property
    def optimizer_shards(self) -> OptimizerShards | None:
        """With ZeRO inside the replicas, their shards (:class:`~.shards.ReplicaShards`); else None."""
        return self._shards

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
        self.inner.on_train_start()
        if self._healed or self._joined:  # every member of the replica was bound again alike
            self._agree_inside_replica()
        self.training = True

    def before_step(self, optimizer: Optimizer) -> bool:
        """The gradient exchange inside the replica; a step it rejects (non-finite gradients, the same
        on every member) still counts for the outer schedule, here (the strategy skips ``after_step``)."""
        accepted = self._exchange_gradients(optimizer)
        if not accepted:
            self._advance_rejected()
        return accepted

    def _exchange_gradients(self, optimizer: Optimizer) -> bool:
        self._advanced = False
        self._restart()
        self._remember(optimizer)
        if self.driver is None and any(f.status == "running" for f in self.fragments):
            self.progress.poll()
        if self._take_inner is not None:  # a replica-mate completed this exchange before a heal
            accepted, grads = self._take_inner
            self._take_inner = None
            for param, grad in zip(self.params, grads, strict=True):
                param.grad = None if grad is None else grad.to(param.device)
        else:
            accepted = self.inner.before_step(optimizer)
        self.inner_steps += 1
        if self.healing:
            self.last_inner = (accepted, [None if p.grad is None else p.grad.detach().clone() for p in self.params])
        return accepted

    def _advance_rejected(self) -> None:
        self._advance()
        self._advanced = True

    def after_step(self, optimizer: Optimizer) -> None:
        self.inner.after_step(optimizer)
        if self._advanced:  # a GradScaler makes the strategy call it after a rejected step: counted already
            self._advanced = False
            return
        self._advance()

    def _remember(self, optimizer: Optimizer) -> None:
        """Note the inner optimizer; load a restored or handed state into it (once)."""
        self._optimizer = optimizer
        if self._send_optimizer is not None:  # a let-in: the replica's first member hands its state on
            send, self._send_optimizer = self._send_optimizer, None
            sent = self.layout.inner.broadcast_object(optimizer_state_of(optimizer, self.params) if send else None)
            self._pending_optimizer = sent
        if self._pending_optimizer is not None:
            pending, self._pending_optimizer = self._pending_optimizer, None
            load_optimizer_state(optimizer, self.params, pending)

    def _advance(self) -> None:
        """Count one step; use the exchanges due now, then start the ones scheduled now."""
        self._restart()
        self.steps += 1
        self._seconds, self._bytes = 0.0, 0
        start = time.perf_counter()
        for index, fragment in enumerate(self.fragments):
            if fragment.status != "idle" and fragment.due <= self.steps:
                self._finish(index, self.rule.mix_alpha)
        for index, offset in enumerate(self.offsets):
            if starts_at(self.steps, offset, self.period):
                self._start(index)
                if self.rule.overlap_steps == 0:
                    self._finish(index, self.rule.mix_alpha)
        self._seconds = time.perf_counter() - start

    def outer_count(self, index: int) -> int:
        """Which outer step (1-based) of fragment ``index`` its last started exchange makes."""
        fragment, offset = self.fragments[index], self.offsets[index]
        return (fragment.started - offset) // self.period + 1 if fragment.started >= offset else 1

    def _start(self, index: int) -> None:
        """Δ of fragment ``index`` from the replica's weights, and the start of its averaging."""
        fragment = self.fragments[index]
        torch.sub(fragment.theta_global, fragment.local.pull(), out=fragment.delta)
        fragment.status, fragment.started = "running", self.steps
        fragment.due = self.steps + self.rule.overlap_steps
        if self.healing:  # what the exchange starts from (it changes Δ and the residuals in place)
            self.snapshots[index] = fragment.delta.clone()
        self._launch(fragment)

    def _launch(self, fragment: ReplicaFragment) -> None:
        self.progress.start(fragment.mean_steps())
        if self.driver is not None:
            self.driver.start()
        self._bytes += fragment.bytes_per_exchange

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
        """Start again, over this binding's layout, the exchanges that were in flight when a rank
        died (:meth:`heal_state`), from the Δ they had started from."""
        for index, fragment in enumerate(self.fragments):
            if fragment.status == "restart":
                fragment.status = "running"
                if self.healing:
                    self.snapshots[index] = fragment.delta.clone()
                self._launch(fragment)

    def _finish(self, index: int, alpha: float, average: bool = False) -> None:
        """The outer step of fragment ``index`` with its mean Δ (``average``, or a warm-up step: the
        replicas' mean instead), then mix it into the replica's weights (``alpha`` 1: leave them)."""
        self._wait()
        fragment = self.fragments[index]
        average = average or averages_at(self.outer_count(index), self.rule.outer_warmup)  # no momentum yet
        apply_mean_delta_(self.outer, fragment.theta_global, fragment.delta, average, fragment.local, alpha)
        fragment.status = "idle"
        self.outer_steps += 1

    def on_train_end(self) -> None:
        """Leave the replicas' mean of the last step in θ_global and every rank's weights: what is in
        flight is completed and the steps since each fragment's exchange are folded in, both by
        averaging (DiLoCo's end: :mod:`lightning_mpi.rules.diloco.rule`)."""
        for index, fragment in enumerate(self.fragments):
            if fragment.status != "idle":
                self._finish(index, 1.0, average=True)
        for index, fragment in enumerate(self.fragments):
            if last_start(self.steps, self.offsets[index], self.period) < self.steps:
                self._start(index)
                self._finish(index, 0.0, average=True)
            fragment.local.push(fragment.theta_global)
        self.inner.on_train_end()
        self.training = False

    # -- healing (module docstring) -------------------------------------------------------------------
    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        exchange = dataclasses.replace(
            gradient_exchange(optimizer, collective=False),  # one replica's: not reconciled across replicas
            where="the gradient exchange inside the replica",
            run=lambda bound: bound._exchange_gradients(optimizer),
        )
        accepted = execute(exchange)
        if not accepted:
            execute(self._outer_operation("the outer exchange", lambda bound: bound._advance_rejected()))
        return accepted

    def healable_after_step(self, optimizer: Optimizer, execute: Execute) -> None:
        execute(self._outer_operation("the outer exchange", lambda bound: bound.after_step(optimizer)))

    def healable_train_end(self, execute: Execute) -> None:
        execute(self._outer_operation("the final average", lambda bound: bound.on_train_end()))

    @staticmethod
    def _outer_operation(where: str, run: Any) -> Operation[None]:
        """A hook that may exchange across replicas, redone from the state and weights before it (a
        finished fragment may have written the weights before another one's exchange failed)."""
        return redone_from_state(
            where,
            run,
            moving=lambda bound: list(bound.params),
            # every member of every replica takes part in each exchange; one replica exchanges nothing (but
            # on SparseLoCo's wire, whose rows a replica of several ranks Allgathers)
            exchanged=lambda bound, before: bound.outer_communicates and bound.outer_steps != before["outer_steps"],
            restore=True,
        )

    def heal_state(self) -> dict[str, Any]:
        """What this rank carries into a healed run (no collective: the others may be gone): the
        outer state (the same on every rank), an exchange in flight as the Δ it started from, and its
        own count of gradient exchanges inside its replica with the last one's result."""
        fragments = []
        for index, fragment in enumerate(self.fragments):
            running = fragment.status in ("running", "restart")
            if running and index not in self.snapshots:
                raise LookupError(f"{self.rule.name}: an exchange was in flight and its start was not kept")
            fragments.append(save_fragment(fragment, self.outer, sent=self.snapshots[index] if running else None))
        return {
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "world_size": self.transport.size,
            "fragments": fragments,
            "local": {
                "inner_steps": self.inner_steps,
                "last_inner": self.last_inner,
                "inner": self.inner.state_dict(),
            },
        }

    def _agree_inside_replica(self) -> None:
        """After a heal or a let-in (collective over the replica): a member that missed the completion
        of the gradient exchange that a replica-mate completed takes its result; a new member takes the
        replica's weights, inner-optimizer state and count from its first member that was there before."""
        healed = self._healed
        self._healed = self._joined = False
        inner = self.layout.inner
        if inner.size == 1:
            return
        counts = inner.allgather_object((self.inner_steps, not healed))
        veterans = [member for member, (_, new) in enumerate(counts) if not new]
        if len(veterans) < len(counts):  # new members: they start from the replica's weights, not θ_global
            if veterans:
                source = veterans[0]
                for fragment in self.fragments:
                    flat = fragment.local.pull()
                    inner.broadcast_(flat, root=source)
                    fragment.local.push()
                self.inner_steps = counts[source][0]
                self._send_optimizer = inner.rank == source
            return
        steps = [count for count, _ in counts]
        if min(steps) == max(steps):
            return
        if max(steps) - min(steps) > 1:
            raise RankFailedError(
                -1,
                f"lightning_mpi: after a heal the survivors of mpi_hybrid's replica {self.layout.replica} are "
                f"{max(steps) - min(steps)} gradient exchanges apart (completed {steps}); they cannot be brought "
                "back in step, and the run fails as with heal=None",
            )
        ahead = steps.index(max(steps))
        sent = inner.broadcast_object(self.last_inner if inner.rank == ahead else None, root=ahead)
        if self.inner_steps < max(steps):
            if sent is None:
                raise RankFailedError(
                    -1,
                    "lightning_mpi: after a heal an mpi_hybrid replica-mate had completed a gradient exchange that "
                    "this rank missed, and kept no result of it; the run fails as with heal=None",
                )
            self._take_inner = sent  # taken by the exchange this rank redoes (and counted there)

    # -- bookkeeping ----------------------------------------------------------------------------------
    @property
    def exchange_in_flight(self) -> bool:
        """Whether an outer exchange was started and has not arrived yet (``overlap_steps``; one
        started again after a heal included)."""
        return any(f.status in ("running", "restart") for f in self.fragments)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        self.inner.close()
        self.layout.free()

    def state_dict(self) -> dict[str, Any]:
        """Collective: completes an exchange in flight (its mean Δ is saved and used at its due step
        after a resume), and gathers each replica's weights and inner-optimizer state (from its first
        member) and every rank's residuals."""
        self._wait()
        replica: dict[str, Any] | None = None
        if self.layout.member == 0:
            optimizer = self._pending_optimizer
            if optimizer is None and self._shards is None:  # ZeRO inside: the strategy saves the shards
                optimizer = optimizer_state_of(self._optimizer, self.params)
            replica = {"weights": local_weights(self.fragments), "optimizer": optimizer}
        mine = {
            "replica": replica,
            "residuals": [fragment.residuals() for fragment in self.fragments],
            "inner": self.inner.state_dict(),
        }
        everyone = self.transport.allgather_object(mine) if self.transport.size > 1 else [mine]
        return {
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "world_size": self.transport.size,
            "fragments": [save_fragment(fragment, self.outer) for fragment in self.fragments],
            "layout": {"table": list(self.layout.table)},
            "replicas": [entry["replica"] for entry in everyone if entry["replica"] is not None],
            "ranks": [{"residuals": entry["residuals"], "inner": entry["inner"]} for entry in everyone],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(
                f"lightning_mpi: the checkpoint holds {len(state['fragments'])} mpi_hybrid fragments, this run has "
                f"{len(self.fragments)}; resume with the fragments the checkpoint was written with"
            )
        self.steps = int(state["steps"])
        self.outer_steps = int(state.get("outer_steps", 0))
        for fragment, saved in zip(self.fragments, state["fragments"], strict=True):
            load_fragment(fragment, self.outer, saved)
            fragment.load_residuals(None)
        self.snapshots.clear()
        self._loaded = True
        if "local" in state:  # a heal: this rank's own part; its replica's weights are the module's
            mine = state["local"]
            self.inner_steps = int(mine["inner_steps"])
            self.last_inner = mine["last_inner"]
            self.inner.load_state_dict(mine["inner"])
            # bound by a heal (not yet started): its replica compares counts when it starts; a redo or a
            # take on a started binding loads this too, and compares nothing
            self._healed = self._healed or not self.training
            return
        if "ranks" not in state:  # a new rank (heal="replace"): θ_global, or its replica's weights
            for fragment in self.fragments:
                fragment.local.push(fragment.theta_global)
            self._joined = True
            return
        self._load_checkpoint(state)

    def _load_checkpoint(self, state: dict[str, Any]) -> None:
        """Each replica's weights and inner-optimizer state, and each rank's residuals, where the
        layout allows (module docstring of :mod:`.state`)."""
        replicas = state["replicas"]
        if len(replicas) == self.layout.replicas:
            saved = replicas[self.layout.replica]
            with torch.no_grad():
                load_local_weights(self.fragments, saved["weights"])
            if self._shards is None and saved["optimizer"] is not None:  # ZeRO inside: the strategy loads the shards
                self._pending_optimizer = list(saved["optimizer"])
        else:
            warnings.warn(
                f"lightning_mpi: the checkpoint holds {len(replicas)} mpi_hybrid replicas, this run has "
                f"{self.layout.replicas}; every replica starts from the global weights and rank 0's optimizer state.",
                RuntimeWarning,
                stacklevel=3,
            )
            for fragment in self.fragments:
                fragment.local.push(fragment.theta_global)
        same_layout = state["layout"]["table"] == self.layout.table
        if same_layout:
            mine = state["ranks"][self.transport.rank]
            for fragment, residuals in zip(self.fragments, mine["residuals"], strict=True):
                fragment.load_residuals(residuals)
            self.inner.load_state_dict(mine["inner"])

    def stats(self) -> dict[str, float]:
        inner = self.inner.stats()
        return {
            "exchange_seconds": self._seconds,
            "wire_bytes": float(self._bytes),
            "bytes_per_exchange": float(max(f.bytes_per_exchange for f in self.fragments)),
            "inner_wire_bytes": float(inner.get("wire_bytes", 0.0)),
            "inner_exchange_seconds": float(inner.get("exchange_seconds", 0.0)),
            "outer_steps": float(self.outer_steps),
            "skipped_steps": float(inner.get("skipped_steps", 0.0)),
            "replicas": float(self.layout.replicas),
            "replica_size": float(self.layout.size),
        }
