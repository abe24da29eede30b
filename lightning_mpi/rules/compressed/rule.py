"""Synchronous gradient averaging with lossy compression and error feedback.

Three wire formats, every one usable by every synchronous step:

- ``"int8"``: ASA with per-chunk min-max 8-bit quantization (fp32 sums, one rounding of the sum);
- ``"onebit"``: ASA with one sign bit per value and two scales per block of 128 values;
- ``"topk"``: each rank sends its ``ratio`` largest-magnitude entries as (index, value) pairs,
  one Allgather, local scatter-add (ranks choose different entries, so there is no ASA chunk).

With ``error_feedback`` (the default) what a rank did not send is kept in a residual and added to
its next gradient; the owner of an ASA chunk also keeps the residual of re-encoding the chunk's
mean. Summed over steps, the applied updates plus the pending residuals equal the mean of the
gradients. Residuals are part of :meth:`BoundCompressedSync.state_dict`, so a checkpoint resumes
them.

Top-k follows Deep Gradient Compression (Lin et al. 2018), each piece switchable, the defaults
being those measured best on digits (``benchmarks/topk_accuracy.py``, docs/convergence.md):

- **Entries per byte** (``topk_packing="delta16"``, on): an entry is one 32-bit word, the gap
  from the previous index (16 bits; a longer gap takes a filler word) and the value in bfloat16,
  instead of an int32 index and a float32 value. Within the bytes of ``ratio`` pairs a rank sends
  about ``2·ratio`` of its entries; the bfloat16 rounding of what it sent stays in its residual.
  Not DGC's, and measured the largest help on digits: each entry waits half as long.
- **Warm-up of the sparsity** (``ratio_warmup_steps``, on: 40 steps): the ratio falls geometrically
  from 1 to ``ratio``. Early on the weights move fast, and an entry held back in a residual for a
  hundred steps points where the weights no longer are. A denser exchange while that lasts costs,
  once per run, the bytes of about ``9·W`` dense exchanges (``Σ ratio_s ≈ 9.1`` over 40 steps;
  a pair is two words and the Allgather brings ``W − 1`` rows; about ``7.5·W`` with ``"delta16"``,
  whose rows stop at one word per entry), then nothing.
- **Momentum correction** (``momentum_correction``, off): sparsifying the gradient and applying
  momentum to the sparse sum is not momentum SGD on the gradients; DGC accumulates the velocity
  ``u = m·u + g`` locally and selects from the sum of velocities. It composes with an optimizer that
  has momentum of its own: the optimizer is handed ``S_t − m·S_(t−1)`` for the exchanged update
  ``S_t``, which makes its momentum buffer ``S_t``, so momentum is applied once
  (:mod:`~lightning_mpi.rules.compressed.momentum_handoff`); at ``ratio=1`` without masking that is exactly
  the optimizer on the mean gradient.
  **Momentum factor masking** (``momentum_masking``) clears the velocity where entries were sent, so
  a stale velocity does not keep pushing a coordinate that was just updated.
- **Local gradient clipping** (``clip_norm``, off): clipping the summed gradient cannot bound what
  accumulates in a residual over many steps, so each rank clips its own gradient before adding it,
  to the global threshold times ``N^(-1/2)``.
- **Layer-wise selection** (``layerwise``, off): ``ratio`` of every tensor instead of one threshold
  per bucket, as DGC selects per layer.

At world size 1 nothing crosses a wire, so nothing is compressed.

Healing: a survivor keeps (:meth:`BoundCompressedSync.heal_state`) the counters and the momentum
hand-off, which every rank holds alike, and, as its own part, its residuals and DGC momenta as the
last completed exchange left them (owned-chunk residuals are dropped: the chunks are cut anew for
the new world size). ``before_step`` is redone as the synchronous rules redo it; a survivor that
takes the exchange's result from another takes its feedback as that exchange left it where its own
part had been encoded (:meth:`~BoundCompressedSync.took_exchange`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import field
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, optional, options_class
from lightning_mpi.rules.buckets import BucketExchanger
from lightning_mpi.rules.compressed.exchanger import CompressedExchanger
from lightning_mpi.rules.compressed.momentum_handoff import MomentumHandoff, optimizer_momentum
from lightning_mpi.rules.sync import BoundSync, SyncRule


@options_class
class CompressedSyncRule(SyncRule):
    """Average gradients every step with a lossy wire format and error feedback (see the module docstring).

    Registered as ``mpi_asa_int8``, ``mpi_topk`` and ``mpi_onebit``.
    """

    name = "compressed"

    # Its own wire option, the lossy formats, where SyncRule's are fp32/fp16/bf16: SyncRule's code
    # only names it in warnings (this rule fixes exchange="asa" and shard_optimizer=False, and brings
    # its own exchanger and check_together).
    wire: Literal["int8", "topk", "onebit"] = option(  # type: ignore[assignment]  # the lossy wires
        default="int8",
        doc='the format on the wire: `"int8"` (ASA with per-chunk min-max 8-bit quantization, fp32 sums), '
        '`"topk"` (each rank sends its `ratio` largest-magnitude entries as (index, value) pairs) or `"onebit"` '
        "(ASA with signs and two scales per block of 128 values).",
    )
    ratio: float = option(
        default=0.01, doc='fraction of entries `"topk"` sends, in (0, 1].', check=number(0.0, 1.0, low_open=True)
    )
    error_feedback: bool = option(
        default=True,
        doc="keep what was not sent and add it to the next step's gradient; the residuals are saved in checkpoints.",
    )
    momentum_correction: bool = option(
        default=False,
        doc='Deep Gradient Compression\'s momentum correction (`wire="topk"` only): each rank accumulates its '
        "velocity `u = m*u + g` and selects from the sum of velocities. With an optimizer that has momentum, it is "
        "handed `(S_t - m*S_(t-1))/(1 - dampening)` for the exchanged update `S_t`, so its momentum buffer is `S_t`: "
        "momentum is applied once. Off: on digits it cost accuracy (docs/convergence.md).",
    )
    momentum: float | None = option(
        default=None,
        doc="the `m` of `momentum_correction`, in [0, 1); None: the optimizer's `momentum`, or 0.9 (DGC's) if it "
        "has none.",
        check=optional(number(0.0, 1.0, high_open=True)),
    )
    momentum_masking: bool = option(
        default=True,
        doc="with `momentum_correction`, DGC's momentum factor masking: clear the velocity where entries were sent, "
        "so a delayed update stops pushing once it landed (False: at `ratio=1` the updates are the optimizer's own).",
    )
    layerwise: bool = option(
        default=False,
        doc="`\"topk\"` chooses `ratio` of every tensor's entries (DGC's per-layer selection; the same wire, "
        '`sum(ceil(ratio*n_i))` pairs) instead of `ratio` of the bucket; needs `topk_packing="pairs"`. Off: on '
        "digits it cost accuracy.",
    )
    topk_packing: Literal["pairs", "delta16"] = option(
        default="delta16",
        doc='how `"topk"` writes an entry: `"delta16"` (the gap from the previous index in 16 bits and the value in '
        'bfloat16: one 4-byte word; the rounding stays in the residual) or `"pairs"` (an int32 index and a float32 '
        'value, 8 bytes). The bytes are those of `ratio` pairs either way, so `"delta16"` sends about twice the '
        'entries: on digits that closed the gap to mpi_asa (docs/convergence.md). `"pairs"` with `layerwise`.',
    )
    clip_norm: float | None = option(
        default=None,
        doc="DGC's local gradient clipping (`\"topk\"` only): before accumulating, each rank scales a bucket's "
        "gradient to an L2 norm of at most `clip_norm * sqrt(n_bucket / n_model) / sqrt(W)`; give your global "
        "clipping threshold (None: no clipping).",
        check=optional(number(0.0, low_open=True)),
    )
    ratio_warmup_start: float = option(
        default=1.0,
        doc="the top-k ratio the warm-up starts from, in (0, 1] (DGC's schedule starts at 0.25); a lower start "
        "costs fewer bytes on a slow link.",
        check=number(0.0, 1.0, low_open=True),
    )
    ratio_warmup_steps: int = option(
        default=40,
        doc="steps over which the top-k ratio falls geometrically from 1 to `ratio` (DGC's warm-up of the "
        "sparsity; 0: none). The first steps move the weights most, when a delayed entry costs most.",
        check=integer(0),
    )

    # Fixed for the lossy wires: ASA carries their chunks, gradients are averaged.
    exchange: Literal["allreduce", "asa"] = field(default="asa", init=False)
    average: Literal["gradients", "weights", "weights+momentum"] = field(default="gradients", init=False)
    topology_aware: bool = field(default=False, init=False)
    # Not offered: an error-feedback residual is a full-size gradient copy per rank, the very memory
    # that sharding frees (see lightning_mpi.rules.zero.rule).
    shard_optimizer: bool = field(default=False, init=False)

    def check_together(self) -> None:
        if self.momentum_correction and self.wire != "topk":
            raise ValueError(
                "momentum_correction=True needs wire='topk' (DGC corrects momentum for sparsified exchange); "
                f"got wire={self.wire!r}"
            )
        if self.topk_packing == "delta16" and self.layerwise:
            raise ValueError(
                "layerwise=True needs topk_packing='pairs' (the default 'delta16' sizes its entries by the "
                "bucket's bytes, not per tensor); pass layerwise=True, topk_packing='pairs'"
            )
        if self.clip_norm is not None and self.wire != "topk":
            raise ValueError(
                f"clip_norm={self.clip_norm!r} needs wire='topk' (DGC's local clipping before accumulation); "
                f"got wire={self.wire!r}"
            )

    @property
    def corrects_momentum(self) -> bool:
        """Whether top-k runs DGC's momentum correction."""
        return self.wire == "topk" and self.momentum_correction

    def ratio_at(self, step: int) -> float:
        """Top-k ratio on update ``step`` (0-based): geometric warm-up from ``ratio_warmup_start`` to ``ratio``."""
        start = self.ratio_warmup_start
        if step >= self.ratio_warmup_steps or start <= self.ratio:
            return self.ratio
        return start * (self.ratio / start) ** (step / self.ratio_warmup_steps)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundCompressedSync:
        return BoundCompressedSync(self, transport, params)


class BoundCompressedSync(BoundSync):
    """Running :class:`CompressedSyncRule`: gradient hooks and skipping as in sync, plus residuals."""

    rule: CompressedSyncRule
    exchanger: CompressedExchanger

    def __init__(self, rule: CompressedSyncRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(rule, transport, params)
        self.dense_bytes = 0
        self._momentum_known = False
        self.handoff = MomentumHandoff(self.buckets)  # used with momentum correction only
        # with ``healing`` set (the strategy heals): this rank's feedback buffers as each exchange left
        # them, for :meth:`heal_state` while the next one is in flight
        self._settled: dict[str, Any] | None = None  # None: as bound (zeros)
        self._interrupted: dict[str, Any] | None = None  # see took_exchange

    def make_exchanger(self, transport: Transport, rule: SyncRule) -> BucketExchanger:
        assert isinstance(rule, CompressedSyncRule)
        return CompressedExchanger(transport, rule)

    def _learn_momentum(self, optimizer: Optimizer) -> None:
        """At the first step: the ``m`` of momentum correction, and whether an optimizer with
        momentum of its own must be handed the update (:mod:`lightning_mpi.rules.compressed.momentum_handoff`)."""
        self._momentum_known = True
        self.exchanger.momentum = optimizer_momentum(optimizer, self.params, self.rule.momentum)
        if self.exchanger.momentum == 0.0:
            self.exchanger.release_momentum()  # m = 0: u = g, plain error feedback
        self.handoff.watch(optimizer)

    def before_step(self, optimizer: Optimizer) -> bool:
        if self.rule.corrects_momentum and not self._momentum_known:
            self._learn_momentum(optimizer)
        if self.transport.size > 1:
            members = {id(p) for g in optimizer.param_groups for p in g["params"]}
            self.dense_bytes = sum(
                self.exchanger.dense_bytes_for(b) for b in self.buckets if any(id(t) in members for t in b.tensors)
            )
        finite = super().before_step(optimizer)
        if not finite:
            # The skipped step's inf/NaN must not live on in the feedback buffers.
            for buf in (*self.exchanger.residuals, *self.exchanger.owner_residuals, *self.exchanger.momenta):
                torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)
        elif self.handoff.active and self.transport.size > 1:
            self.handoff.hand_off(optimizer)
        if self.transport.size > 1:
            self.exchanger.step += 1
        self.exchanger.in_flight, self.exchanger.started = False, 0
        self._interrupted = None
        if self.healing and self.transport.size > 1:
            self._settled = self._local_state()
        return finite

    def _snapshot_stats(self) -> None:
        wire = self.exchanger.wire_bytes
        super()._snapshot_stats()
        self._last["dense_bytes"] = float(self.dense_bytes)
        self._last["compression"] = float(self.dense_bytes / wire) if wire else 1.0
        if self.exchanger.topk:
            self._last["ratio"] = self.exchanger.current_ratio()

    # -- checkpoints: residuals differ per rank, so every rank's go into the checkpoint ------------
    def _local_state(self) -> dict[str, Any]:
        ex = self.exchanger
        return {
            "residuals": [t.detach().cpu().clone() for t in ex.residuals],
            "owner_residuals": [t.detach().cpu().clone() for t in ex.owner_residuals],
            "momenta": [t.detach().cpu().clone() for t in ex.momenta],
        }

    def replicated_state(self) -> dict[str, Any]:
        """What every rank holds alike (counters, the momentum hand-off's ``S_(t−1)``); no collective.
        It changes only once an exchange completed."""
        state = super().state_dict()
        state["step"] = self.exchanger.step
        state["world_size"] = self.transport.size
        state["codec"] = self.rule.wire  # under the key that earlier checkpoints use
        if self._momentum_known:
            state["momentum"] = self.exchanger.momentum
        state.update(self.handoff.state_dict())  # the same on every rank
        return state

    def state_dict(self) -> dict[str, Any]:
        """Collective on every rank (Lightning saves checkpoints on all ranks; rank 0 writes)."""
        state = self.replicated_state()
        if self.transport.size > 1:
            state["ranks"] = self.transport.allgather_object(self._local_state())
        return state

    def heal_state(self) -> dict[str, Any]:
        """What this rank carries into a healed run (``heal="shrink"``; no collective: the others may
        be gone): :meth:`replicated_state` and, as ``"local"``, this rank's own residuals and momenta
        as the last completed exchange left them (an interrupted exchange may have updated some of
        them: it is redone from there). Owned-chunk residuals are not kept: the chunks are cut anew
        for the new world size (as when a checkpoint resumes at another world size)."""
        state = self.replicated_state()
        if self.transport.size > 1:
            ex = self.exchanger
            state["local"] = self._settled if ex.in_flight else self._local_state()
            # every bucket started: this rank's part of the interrupted exchange is encoded (what
            # it sends is chosen, its residual updated) before anything waits for another rank
            state["interrupted"] = self._local_state() if ex.in_flight and ex.started >= len(self.buckets) else None
        return state

    def took_exchange(self, own_grads: Sequence[Tensor | None]) -> None:
        """After a heal, this rank took the result of the exchange it was in from a survivor that
        completed it: its feedback is what that exchange left (:meth:`heal_state`'s
        ``"interrupted"``) where its part had been encoded, else it stays as before the exchange
        (that step's compression error on this rank is then not fed back)."""
        if self._interrupted is not None:
            self._load_local(self._interrupted)
            self._settled = self._local_state()
            self._interrupted = None

    def _load_local(self, mine: dict[str, Any] | None) -> None:
        """This rank's own residuals and momenta from :meth:`heal_state` (``None``: zeros). Members
        sit at the same offsets at any world size; only the padding differs."""
        ex = self.exchanger
        for name in ("residuals", "momenta"):
            for bucket, dst, src in zip(self.buckets, getattr(ex, name), (mine or {}).get(name, []), strict=False):
                if dst.numel() and src.numel():
                    dst.zero_()
                    dst[: bucket.numel].copy_(src[: bucket.numel])
        for buf in ex.owner_residuals:
            buf.zero_()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load(state)
        if self.transport.size > 1:
            self._settled = self._local_state()  # the feedback as loaded, until an exchange completes

    def _load(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.exchanger.step = int(state.get("step", 0))
        if "momentum" in state and self.rule.momentum is None:
            # Known before the resumed run's first exchange, which already needs it.
            self.exchanger.momentum = float(state["momentum"])
        if state.get("codec") == self.rule.wire:
            self.handoff.load_state_dict(state)
        if "local" in state:  # a heal: this rank's own feedback (see heal_state)
            if self.transport.size > 1:
                self._load_local(state["local"])
                self._interrupted = state.get("interrupted")
            return
        ranks = state.get("ranks")
        if not ranks or self.transport.size == 1:
            return
        ex = self.exchanger
        if state.get("codec") != self.rule.wire:
            warnings.warn(
                f"lightning_mpi: checkpoint residuals are for wire={state.get('codec')!r}, not "
                f"{self.rule.wire!r}; starting with empty residuals.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if int(state.get("world_size", 0)) == self.transport.size:
            mine = ranks[self.transport.rank]
            for name in ("residuals", "owner_residuals", "momenta"):
                for dst, src in zip(getattr(ex, name), mine[name], strict=True):
                    if name == "momenta" and not src.numel():
                        continue  # released (the optimizer had no momentum): nothing to restore
                    if dst.shape != src.shape:
                        raise ValueError(
                            f"checkpoint {name} of shape {tuple(src.shape)} do not fit buffers of {tuple(dst.shape)}"
                        )
                    dst.copy_(src)
            return
        # Another world size: the pending mass of the mean update is mean(residuals); every rank
        # gets that mean, which keeps it. Owned-chunk residuals depend on the chunking: dropped.
        warnings.warn(
            f"lightning_mpi: checkpoint from {state.get('world_size')} ranks restored on {self.transport.size}: "
            "residuals are averaged, owned-chunk residuals dropped.",
            RuntimeWarning,
            stacklevel=2,
        )
        for name in ("residuals", "momenta"):
            for i, dst in enumerate(getattr(ex, name)):
                parts = [r[name][i] for r in ranks]
                n = min(dst.numel(), *(p.numel() for p in parts))
                if n:
                    dst.zero_()
                    dst[:n].copy_(torch.stack([p[:n] for p in parts]).mean(dim=0))

    def stats(self) -> dict[str, float]:
        return dict(self._last)


__all__ = ["BoundCompressedSync", "CompressedExchanger", "CompressedSyncRule"]
