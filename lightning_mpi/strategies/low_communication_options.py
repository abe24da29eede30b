"""Typed, documented constructor arguments of the low-communication strategies.

The same contract as :mod:`lightning_mpi.strategies.options` (one class per strategy, which turns
its arguments into a validated :class:`~lightning_mpi.rules.base.Rule` and passes the rest on with
``**kwargs``), kept apart so that neither module grows past a screenful of classes.
"""
from __future__ import annotations

from typing import Any

from lightning_mpi.rules.powersgd import PowerSGDRule


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
