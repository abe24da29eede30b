"""Typed, documented constructor arguments of the low-communication strategies.

The same contract as :mod:`lightning_mpi.strategies.options` (one class per strategy, which turns
its arguments into a validated :class:`~lightning_mpi.rules.base.Rule` and passes the rest on with
``**kwargs``), kept apart so that neither module grows past a screenful of classes.
"""
from __future__ import annotations

from typing import Any, Literal

from lightning_mpi.rules.diloco import DiLoCoRule
from lightning_mpi.rules.powersgd import PowerSGDRule
from lightning_mpi.rules.streaming_diloco import StreamingDiLoCoRule


class PowerSGDOptions:
    """PowerSGD (Vogels et al. 2019): average a rank-``rank`` approximation of every matrix-shaped
    gradient, found by one warm-started power-iteration step, with error feedback. Registered as
    ``mpi_powersgd``.

    Each step a rank sends ``(n + m)·r`` numbers per ``n × m`` gradient (a convolution's weight
    viewed as ``(out_channels, rest)``) in two Allreduces, instead of ``n·m``; 1-D tensors and
    matrices that would not shrink enough are averaged uncompressed. The exchange starts from the
    gradient hooks, so it overlaps backward. The warm-start Q's, every rank's residuals and the
    step count are saved in checkpoints, so a resumed run continues exactly.

    Args:
        rank: rank r of the approximation (≥ 1); each matrix gets ``min(n, m, rank)``. Torch
            suggests 1, then 2, 4, ... until the accuracy is good enough.
        start_step: updating steps of plain averaging of every gradient before compression
            starts (≥ 0). Torch's docs suggest ~10% of training when compressing from the
            start costs accuracy.
        min_compression_rate: compress a matrix only if ``(n + m)·r`` is smaller than ``n·m`` by
            more than this factor (≥ 0; 0 compresses every matrix).
        warm_start: start each step's power iteration from the previous step's Q (else a fresh
            random Q every step).
        use_error_feedback: add what the approximation missed on this rank to its next gradient.
        seed: seed of the random Q's (≥ 0), the same on every rank.
        bucket_mb: exchange bucket size in MiB (> 0): a bucket's P's travel in one Allreduce, its
            Q's in another.
        first_bucket_mb: size of the first bucket (the last layers) in MiB (> 0).
        overlap: launch each bucket's exchange from the gradient hooks during backward.
        **kwargs: the options every strategy takes (see ``MPIStrategy``); ``log_stats`` logs
            ``exchange_seconds``, ``wire_bytes``, ``dense_bytes``, ``compression`` and
            ``skipped_steps`` under ``mpi/powersgd/``.
    """

    def __init__(
        self,
        rank: int = 1,
        start_step: int = 0,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        use_error_feedback: bool = True,
        seed: int = 0,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        overlap: bool = True,
        **kwargs: Any,
    ) -> None:
        rule = PowerSGDRule(
            rank=rank,
            start_step=start_step,
            min_compression_rate=min_compression_rate,
            warm_start=warm_start,
            use_error_feedback=use_error_feedback,
            seed=seed,
            bucket_mb=bucket_mb,
            first_bucket_mb=first_bucket_mb,
            overlap=overlap,
        )
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class DiLoCoOptions:
    """DiLoCo (Douillard et al. 2023): registered as ``mpi_diloco``.

    Each rank runs ``period`` steps of your own optimizer (the inner optimizer; the paper uses
    AdamW), then the ranks average their pseudo-gradients Δ = θ_global − θ_local and an outer
    SGD with Nesterov momentum moves the global weights, from which every rank continues. One
    exchange every ``period`` steps. A checkpoint holds the global weights, the outer momentum
    and every rank's local weights, inner-optimizer state and residuals, so resuming mid-period
    is exact. When training ends every rank holds the global weights.

    Args:
        period: H, inner steps between outer steps (≥ 1). Default 50 (the paper's 500 is made for
            runs of tens of thousands of steps).
        outer_lr: outer learning rate (> 0). Default 0.7 (the paper's).
        outer_momentum: outer Nesterov momentum in [0, 1); 0 is plain SGD. Default 0.9 (the paper's).
            ``outer_lr=1, outer_momentum=0`` is periodic model averaging (``mpi_model_avg``).
        wire: how Δ travels: ``"fp32"`` (one Allreduce), ``"bf16"``, ``"int8"`` or ``"int4"`` (ASA
            with error feedback).
        **kwargs: the options every strategy takes (see ``MPIStrategy``); ``log_stats`` logs
            exchange time, bytes and outer steps under ``mpi/diloco/``.
    """

    def __init__(self, period: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 wire: Literal["fp32", "bf16", "int8", "int4"] = "fp32", **kwargs: Any) -> None:
        rule = DiLoCoRule(period=period, outer_lr=outer_lr, outer_momentum=outer_momentum, wire=wire)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class StreamingDiLoCoOptions:
    """Streaming DiLoCo (Douillard et al. 2025): registered as ``mpi_streaming_diloco``.

    DiLoCo with the parameters cut into ``fragments`` contiguous groups of whole tensors, each
    exchanged every ``period`` steps on a staggered schedule (one fragment every period/fragments
    steps), each exchange overlapped with ``overlap_steps`` inner steps and mixed into the local
    weights with ``mix_alpha``. Peak bytes per exchange are about 1/fragments of DiLoCo's.

    Args:
        period: H, inner steps between two exchanges of one fragment (≥ 1). Default 50.
        fragments: P, the number of fragments (≥ 1, ≤ period). Default 4. A model with fewer
            trainable tensors runs with one fragment per tensor (and a warning).
        overlap_steps: τ, inner steps between the start of a fragment's exchange and its use
            (0: blocking); below period // fragments. Default 1.
        mix_alpha: α in [0, 1): the arriving fragment sets θ_local ← α·θ_local + (1 − α)·θ_global.
            Default 0.5 (the paper's).
        outer_lr: outer learning rate (> 0). Default 0.7.
        outer_momentum: outer Nesterov momentum in [0, 1). Default 0.9.
        wire: ``"fp32"``, ``"bf16"``, ``"int8"`` or ``"int4"`` (lossy ones with error feedback).
            Default ``"int4"`` (the paper's 4-bit outer gradients).
        **kwargs: the options every strategy takes (see ``MPIStrategy``); ``log_stats`` logs
            exchange time, bytes (``peak_exchange_bytes``) and outer steps under ``mpi/streaming_diloco/``.
    """

    def __init__(self, period: int = 50, fragments: int = 4, overlap_steps: int = 1, mix_alpha: float = 0.5,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 wire: Literal["fp32", "bf16", "int8", "int4"] = "int4", **kwargs: Any) -> None:
        rule = StreamingDiLoCoRule(period=period, fragments=fragments, overlap_steps=overlap_steps, mix_alpha=mix_alpha,
                                   outer_lr=outer_lr, outer_momentum=outer_momentum, wire=wire)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]
