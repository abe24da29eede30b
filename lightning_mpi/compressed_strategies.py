"""Strategies for compressed synchronous exchange: ``mpi_asa_int8``, ``mpi_topk``, ``mpi_onebit``."""
from __future__ import annotations

from typing import Any, Literal

from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.strategy import MPIStrategy


class CompressedSyncStrategy(MPIStrategy):
    """Average gradients every step with a lossy wire format and error feedback.

    Args:
        codec: ``"int8"`` (ASA with per-chunk min-max 8-bit quantization, fp32 sums),
            ``"topk"`` (each rank sends its ``ratio`` largest-magnitude entries as (index, value)
            pairs) or ``"onebit"`` (ASA with signs and two per-chunk scales).
        ratio: fraction of entries sent by ``"topk"``, in (0, 1].
        error_feedback: keep what was not sent and add it to the next step's gradient; the
            residuals are saved in checkpoints.
        momentum_correction: Deep Gradient Compression's momentum correction (``"topk"`` only):
            momentum is applied locally before sparsification; use an optimizer without momentum
            with it. (Not the asynchronous strategies' ``momentum_correction``, which lowers the
            optimizer's momentum by the momentum that asynchrony adds.)
        momentum: momentum of ``momentum_correction``, in [0, 1).
        ratio_warmup_steps: steps over which the top-k ratio falls geometrically from 1 to
            ``ratio`` (0 = none).
        bucket_mb: exchange bucket size in MiB (> 0).
        first_bucket_mb: size of the first bucket in MiB (> 0).
        overlap: start each bucket's exchange from the gradient hooks during backward.
        segment_mb: each bucket is exchanged as a pipeline of segments of this size (MiB).
        **kwargs: the options every strategy takes (see :class:`~lightning_mpi.strategy.MPIStrategy`):
            ``log_stats`` (exchange time, bytes on the wire, compression factor under
            ``mpi/compressed/``), ``abort_on_exception``, ``collective_timeout``, ``lr_scaling``,
            ``warmup_steps``.
    """

    def __init__(
        self,
        codec: Literal["int8", "topk", "onebit"] = "int8",
        ratio: float = 0.01,
        error_feedback: bool = True,
        momentum_correction: bool = False,
        momentum: float = 0.9,
        ratio_warmup_steps: int = 0,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        segment_mb: float = 4.0,
        first_bucket_mb: float = 1.0,
        **kwargs: Any,
    ) -> None:
        rule = CompressedSyncRule(
            codec=codec,
            ratio=ratio,
            error_feedback=error_feedback,
            momentum_correction=momentum_correction,
            momentum=momentum,
            ratio_warmup_steps=ratio_warmup_steps,
            bucket_mb=bucket_mb,
            overlap=overlap,
            segment_mb=segment_mb,
            first_bucket_mb=first_bucket_mb,
        )
        super().__init__(rule=rule, **kwargs)
