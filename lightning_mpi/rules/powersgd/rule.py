"""PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, arXiv:1905.13727): the algorithm and the rule (its math
as pure functions: :mod:`.lowrank`).

Every matrix-shaped gradient Mᵢ (``n × m`` on rank i; a convolution's weight viewed as
``(out_channels, rest)``) is replaced by a rank-``r`` approximation of the mean gradient, found
by one step of power iteration from the previous step's Q (Vogels et al. Algorithm 1)::

    Mᵢ ← Mᵢ + eᵢ                       error feedback: what earlier steps did not apply
    Pᵢ = Mᵢ Q                          Q: (m × r), warm-started, orthogonalised
    P  = (1/W) Σᵢ Pᵢ                   Allreduce (the compression is linear)
    P̂  = orthogonalise(P)              orthonormal columns (QR; for r = 1, P/‖P‖)
    Qᵢ = Mᵢᵀ P̂
    Q  = (1/W) Σᵢ Qᵢ                   Allreduce; kept as next step's warm start
    M̂  = P̂ Qᵀ                          = P̂ P̂ᵀ (1/W) Σᵢ Mᵢ: the same on every rank
    eᵢ ← Mᵢ − M̂                         this rank's residual

Per step each rank sends (n + m)·r numbers per matrix instead of n·m. At full rank
(r = min(n, m)) P̂ P̂ᵀ projects onto a space that holds the mean's columns, so M̂ is the exact
mean: PowerSGD then equals plain averaging. Tensors that compression would not shrink by at
least ``min_compression_rate`` (``(n + m)·r·rate ≥ n·m``), and every 1-D tensor (biases, norms),
are averaged uncompressed. Before ``start_step`` every gradient is averaged plainly.

As in torch's ``powerSGD_hook`` (which this follows, so results compare): the warm Q is
orthogonalised before it is used (the span, hence M̂, is the same; it keeps Q well scaled), a
fresh Q is drawn from a generator seeded identically on every rank (``seed``, the step and the
bucket), and all P's of a bucket travel in one Allreduce with its uncompressed tensors, all Q's
in a second. Buckets are filled from the last layer back and launched from gradient hooks as
soon as their gradients are ready, so the exchange overlaps the rest of backward.

Defaults, cited: rank 1, ``min_compression_rate`` 2, warm start and error feedback on (torch's
``PowerSGDState``). ``start_step`` 0 as in the paper (torch defaults to 1000 plain steps, partly
for a reason of its own, DDP's bucket rebuild; its docs suggest ~10% of training when accuracy
suffers).

Healing: a survivor keeps (:meth:`BoundPowerSGD.heal_state`) the step counts and the warm Q's, which
every rank holds alike (the averaged Q of the last exchange), and its own residuals, all as before
the exchange in flight; ``before_step`` is redone as the synchronous rules redo it, or its result
taken with the replicated state from a survivor that completed it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.comm.engine import Exchange, ExchangeScheduler
from lightning_mpi.comm.errors import ProcessFailed
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.base import BoundRule, Execute, gradient_exchange
from lightning_mpi.rules.buckets import Buckets
from lightning_mpi.rules.exposed_warning import ExposedExchangeWarning
from lightning_mpi.rules.powersgd.bucket import PowerSGDBucket
from lightning_mpi.rules.powersgd.lowrank import (
    compression_rank,
    matrix_shape,
    orthogonalize_,
    power_step,
    q_seed,
    random_qs,
)


# -- the rule -------------------------------------------------------------------------------------
@options_class
class PowerSGDRule(Buckets):
    """PowerSGD (Vogels et al. 2019): average a rank-``rank`` approximation P Qᵀ of every matrix-shaped
    gradient, found by one warm-started power-iteration step, with error feedback (see the module
    docstring). Registered as ``mpi_powersgd``.

    Each step a rank sends ``(n + m)·r`` numbers per ``n × m`` gradient (a convolution's weight
    viewed as ``(out_channels, rest)``) in two Allreduces per bucket (its P's, then its Q's),
    instead of ``n·m``; 1-D tensors and matrices that would not shrink enough are averaged
    uncompressed. The warm-start Q's, every rank's residuals and the step count are saved in
    checkpoints, so a resumed run continues exactly.
    """

    name = "powersgd"

    rank: int = option(
        default=1,
        doc="r, the rank of the approximation (≥ 1); a matrix gets min(n, m, rank). Torch suggests 1, then 2, 4, ... "
        "until the accuracy is good enough.",
        check=integer(1),
    )
    start_step: int = option(
        default=0,
        doc="updating steps of plain averaging before compression starts (≥ 0); torch suggests about 10% of training "
        "when compressing from the start costs accuracy.",
        check=integer(0),
    )
    min_compression_rate: float = option(
        default=2.0,
        doc="compress a matrix only if (n + m)·r is smaller than n·m by more than this factor (≥ 0; 0 compresses "
        "every matrix).",
        check=number(0.0, math.inf, high_open=True),
    )
    warm_start: bool = option(
        default=True,
        doc="start each step's power iteration from the previous step's Q (else a fresh random Q every step).",
    )
    error_feedback: bool = option(
        default=True, doc="add what the approximation missed on this rank to its next gradient."
    )
    seed: int = option(default=0, doc="seed of the random Q's (≥ 0), the same on every rank.", check=integer(0))

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundPowerSGD:
        return BoundPowerSGD(self, transport, params)


class BoundPowerSGD(BoundRule):
    """Running :class:`PowerSGDRule`: buckets launched from gradient hooks, finished in ``before_step``.

    A step whose exchanged gradients hold inf or NaN (the same on every rank) is skipped on every
    rank; its inf/NaN are cleared from the residuals and a non-finite warm Q is replaced by a
    fresh one. ``state_dict`` holds the step count, the warm Q's and every rank's residuals.
    """

    def __init__(self, rule: PowerSGDRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params)
        self.rule = rule
        self.steps = 0  # updating steps so far: decides plain or compressed, seeds fresh Q's
        self.skipped_steps = 0
        self.hook_launches = 0
        self._index = {id(p): i for i, p in enumerate(self.params)}  # checkpoint keys
        self.buckets: list[PowerSGDBucket] = []
        self.progress = ExchangeScheduler(transport.timeout, transport.rank, transport.size, comm=transport.comm)
        self.driver: ProgressThread | None = None
        self._hooks: list[Any] = []
        self._last: dict[str, float] = {}
        self._seconds = 0.0
        self._hook_failure: ProcessFailed | None = None  # a dead rank noticed by a gradient hook
        self.exposed_warning = ExposedExchangeWarning(
            f"the every-step PowerSGD exchange (rank {rule.rank})", transport.rank, transport.size
        )
        # with ``healing`` set (the strategy heals): this rank's state as it was before each exchange
        # (:meth:`heal_state`), since committing buckets one by one changes it part-way
        self._before: dict[str, Any] | None = None
        if transport.size == 1:
            return  # nothing crosses a wire, so nothing is compressed

        def rank_for(shape: torch.Size) -> int:
            return compression_rank(shape, rule.rank, rule.min_compression_rate)

        plain_buckets = make_buckets(
            self.params,
            1,
            bucket_bytes=rule.bucket_bytes(),
            first_bucket_bytes=rule.first_bucket_bytes(),
        )
        # Each bucket on its own communicator: hooks may start them in any order on each rank.
        self.buckets = [PowerSGDBucket(b, transport.dup(), rank_for, rule.error_feedback) for b in plain_buckets]
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._replayed = False  # a gradient arrived after its bucket left: redo in before_step
        self._arrived: list[int] = []
        if rule.overlap:
            self.driver = ProgressThread(
                self.progress.try_poll,
                2e-4,
                "PowerSGDRule(overlap=True)",
                running=False,
                remedy=", or pass overlap=False",
            )
            for index, bucket in enumerate(self.buckets):
                for tensor in bucket.bucket.tensors:
                    self._hooks.append(tensor.register_post_accumulate_grad_hook(self._make_hook(index)))

    @property
    def compressing(self) -> bool:
        """Whether this step compresses (``start_step`` reached)."""
        return self.steps >= self.rule.start_step

    # -- launching -------------------------------------------------------------------------------
    def _make_hook(self, index: int):
        def on_grad_ready(_param: Tensor) -> None:
            if not self.sync_enabled or self._hook_failure is not None:
                return
            self._ready[index] += 1
            members = len(self.buckets[index].bucket.tensors)
            try:
                if self._ready[index] == members:
                    self.hook_launches += 1
                    self._launch(index)
                elif self._ready[index] > members:
                    self._replayed = True  # a second backward before the step
                self.progress.poll()  # MPICH moves data only inside MPI calls
            except ProcessFailed as failure:
                # A dead rank (ULFM) noticed during backward: backward completes, and the exchange
                # raises it, where a healing strategy redoes the exchange with whole gradients.
                self._hook_failure = failure

        return on_grad_ready

    def _launch(self, index: int) -> None:
        begin = time.perf_counter()
        bucket, compressing = self.buckets[index], self.compressing
        fresh = None
        if compressing and (not self.rule.warm_start or not bucket.q_ready):
            seed = q_seed(self.rule.seed, self.steps, index)
            fresh = lambda shapes: random_qs(shapes, seed, bucket.bucket.flat.dtype)  # noqa: E731
        bucket.begin(compressing, fresh)
        self._launched[index] = True
        if self.driver is not None:
            self.driver.start()
        self.progress.start(self._exchange(index, compressing))
        self._seconds += time.perf_counter() - begin

    def _exchange(self, index: int, compressing: bool) -> Exchange:
        yield from self.buckets[index].steps(compressing)
        self._arrived.append(index)

    def _reset_overlap(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._replayed = False
        self._arrived.clear()

    # -- the step --------------------------------------------------------------------------------
    def before_step(self, optimizer: Optimizer) -> bool:
        if self.transport.size == 1:
            self.steps += 1
            return True
        if self._hook_failure is not None:
            failure, self._hook_failure = self._hook_failure, None
            raise failure
        begin = time.perf_counter()
        self.exposed_warning.wait_begins()
        if self.healing:
            # residuals and warm Q's change only in the commits below (the launches in backward
            # leave them alone), so this is the state from which an interrupted exchange is redone
            self._before = self._local_state()
        compressing = self.compressing
        members = {id(p) for g in optimizer.param_groups for p in g["params"]}
        wanted = {i for i, b in enumerate(self.buckets) if any(id(t) in members for t in b.bucket.tensors)}
        if self._replayed:
            self.progress.wait_all()  # drop what left early: the gradients changed since
            self._launched = [False] * len(self.buckets)
            self._arrived.clear()
        for index in sorted(wanted):
            if not self._launched[index]:  # overlap off, or a member got no gradient
                self._launch(index)
        finite: dict[int, bool] = {}

        def commit_arrived() -> None:
            # Committed as they arrive, while later buckets are still on the wire. Even when
            # non-finite: a GradScaler decides from .grad, and must see what every rank sees.
            while self._arrived:
                index = self._arrived.pop(0)
                if index in wanted:
                    finite[index] = self.buckets[index].commit(compressing, self.rule.warm_start)

        commit_arrived()
        self.progress.wait_all(commit_arrived)
        commit_arrived()
        if self.driver is not None:
            self.driver.pause()
        self._reset_overlap()
        self._before = None
        self.steps += 1
        ok = all(finite.get(index, False) for index in wanted)
        if not ok:
            self.skipped_steps += 1
            for bucket in self.buckets:
                bucket.forget_non_finite()
            warnings.warn(
                "lightning_mpi: non-finite gradients after the PowerSGD exchange; skipping this optimizer step "
                f"on every rank ({self.skipped_steps} skipped so far).",
                RuntimeWarning,
                stacklevel=2,
            )
        self._snapshot_stats(wanted, compressing, time.perf_counter() - begin)
        self.exposed_warning.wait_ends()
        return ok

    def healable_before_step(self, optimizer: Optimizer, execute: Execute) -> bool:
        """Healing: the exchange redone with this rank's own gradients put back, or taken with the
        replicated state (:meth:`replicated_state`) from a survivor that completed it."""
        return execute(gradient_exchange(optimizer))

    def after_step(self, optimizer: Optimizer) -> None:
        self.exposed_warning.step_ends()

    def _snapshot_stats(self, wanted: set[int], compressing: bool, seconds: float) -> None:
        world = self.transport.size
        factor = 2 * (world - 1) / world * self.buckets[0].bucket.flat.element_size() if self.buckets else 0.0
        wire = sum(self.buckets[i].wire_numel(compressing) for i in wanted) * factor
        dense = sum(self.buckets[i].bucket.flat.numel() for i in wanted) * factor
        self._last = {
            "exchange_seconds": self._seconds + seconds,
            "wire_bytes": float(wire),
            "dense_bytes": float(dense),
            "compression": float(dense / wire) if wire else 1.0,
            "skipped_steps": float(self.skipped_steps),
        }
        self._seconds = 0.0

    # -- bookkeeping -----------------------------------------------------------------------------
    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.progress.wait_all()
        if self.driver is not None:
            self.driver.close()
            self.driver = None
        for bucket in self.buckets:
            if bucket.team is not None:
                bucket.team.free()
                bucket.team = None

    def stats(self) -> dict[str, float]:
        return dict(self._last)

    def _by_parameter(self, tensor_of) -> list[Tensor | None]:
        """``tensor_of(bucket, member)`` for every compressed parameter, by its position in
        ``params`` (``None`` elsewhere): a layout that does not depend on the buckets."""
        out: list[Tensor | None] = [None] * len(self.params)
        for bucket in self.buckets:
            for c in bucket.compressed:
                value = tensor_of(bucket, c)
                if value is not None:
                    out[self._index[id(bucket.bucket.tensors[c.member])]] = value.detach().cpu().clone()
        return out

    def replicated_state(self) -> dict[str, Any]:
        """What every rank holds alike: the step counts and the warm Q's (each exchange ends with the
        averaged Q on every rank); no collective."""
        state: dict[str, Any] = {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "world_size": self.transport.size,
            "q": [],
        }
        if self.transport.size > 1:
            state["q"] = self._by_parameter(lambda b, c: b.q(c, b.q_state) if b.q_ready else None)
        return state

    def _local_state(self) -> dict[str, Any]:
        """:meth:`replicated_state` and, as ``"local"``, this rank's residuals by parameter."""
        state = self.replicated_state()
        if self.transport.size > 1:
            state["local"] = self._by_parameter(lambda b, c: b.residual_of(c) if b.residual is not None else None)
        return state

    def heal_state(self) -> dict[str, Any]:
        """What this rank carries into a healed run (``heal="shrink"``; no collective: the others may
        be gone): the step counts, the warm Q's (replicated: every survivor holds the same) and its
        own residuals, all as they were before an exchange in flight (it is redone from there)."""
        return self._before if self._before is not None else self._local_state()

    def took_exchange(self, own_grads: Sequence[Tensor | None]) -> None:
        """After a heal, this rank took the result of the exchange it was in (the gradients, and
        :meth:`replicated_state`: counts and warm Q's) from a survivor that completed it; its
        residual, still as before that exchange, becomes what the exchange would have left:
        ``e ← M + e − M̂``, this rank's own gradient ``M`` (``own_grads``, by parameter) plus its
        residual, less the approximation ``M̂`` every rank applies (the gradient taken)."""
        if self.transport.size == 1 or self.steps - 1 < self.rule.start_step:
            return  # a plain step: nothing fed back
        for bucket in self.buckets:
            if bucket.residual is None:
                continue
            for c in bucket.compressed:
                tensor = bucket.bucket.tensors[c.member]
                own = own_grads[self._index[id(tensor)]]
                if own is None or tensor.grad is None:
                    continue
                residual = bucket.residual_of(c)
                residual.add_(own.reshape(c.n, c.m).to(residual.dtype))
                residual.sub_(tensor.grad.reshape(c.n, c.m).to(residual.dtype))

    def state_dict(self) -> dict[str, Any]:
        """Collective on every rank (Lightning saves on every rank; rank 0 writes): the step count,
        the warm Q's (the same on every rank) and, gathered to rank 0 only, every rank's residuals
        (``"ranks"`` is ``None`` on the other ranks)."""
        state: dict[str, Any] = {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "world_size": self.transport.size,
            "q": [],
            "ranks": None,
        }
        if self.transport.size == 1:
            return state
        state["q"] = self._by_parameter(lambda b, c: b.q(c, b.q_state) if b.q_ready else None)
        mine = self._by_parameter(lambda b, c: b.residual_of(c) if b.residual is not None else None)
        state["ranks"] = self.transport.gather_object(mine, root=0)  # watched: a failed rank ends the wait
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.transport.size == 1:
            return
        saved_q = state.get("q") or [None] * len(self.params)
        ranks = state.get("ranks")
        if len(saved_q) != len(self.params):
            warnings.warn(
                "lightning_mpi: the checkpoint's PowerSGD state is for another model; starting afresh.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        same_world = int(state.get("world_size", 0)) == self.transport.size
        if "local" in state:  # a heal: this rank's own residuals (heal_state)
            ranks, same_world = None, True
        local = state.get("local")
        if ranks and not same_world:
            warnings.warn(
                f"lightning_mpi: PowerSGD residuals from {state.get('world_size')} ranks restored on "
                f"{self.transport.size}: every rank gets their mean (which keeps the pending mean update).",
                RuntimeWarning,
                stacklevel=2,
            )
        for bucket in self.buckets:
            restored = bool(bucket.compressed)
            for c in bucket.compressed:
                index = self._index[id(bucket.bucket.tensors[c.member])]
                q = saved_q[index]
                if q is not None and tuple(q.shape) == (c.m, c.r):
                    bucket.q(c, bucket.q_state).copy_(q)
                else:
                    restored = False
                if bucket.residual is not None and local is not None:
                    bucket.residual_of(c).zero_()
                    if local[index] is not None and tuple(local[index].shape) == (c.n, c.m):
                        bucket.residual_of(c).copy_(local[index])
                elif bucket.residual is not None and ranks:
                    parts = [r[index] for r in ranks if r[index] is not None]
                    residual = (
                        parts[self.transport.rank]
                        if same_world and len(parts) == len(ranks)
                        else (torch.stack(parts).mean(dim=0) if parts else None)
                    )
                    if residual is not None and tuple(residual.shape) == (c.n, c.m):
                        bucket.residual_of(c).copy_(residual)
            bucket.q_ready = restored


__all__ = ["PowerSGDRule", "BoundPowerSGD", "compression_rank", "orthogonalize_", "power_step", "matrix_shape"]
