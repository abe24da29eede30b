"""Strategies for compressed synchronous exchange: ``mpi_asa_int8``, ``mpi_topk``, ``mpi_onebit``."""
from __future__ import annotations

from typing import Literal, Optional

import pytorch_lightning as pl
from pytorch_lightning.plugins import CheckpointIO, Precision

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
        momentum_correction: Deep Gradient Compression's momentum correction (``"topk"`` only);
            use an optimizer without momentum with it.
        momentum: momentum of ``momentum_correction``, in [0, 1).
        ratio_warmup_steps: steps over which the top-k ratio falls geometrically from 1 to
            ``ratio`` (0 = none).
        bucket_mb: exchange bucket size in MiB (> 0).
        overlap: start each bucket's exchange from the gradient hooks during backward.
        segment_mb: ASA pipelines each bucket in segments of this size (MiB).
        log_stats: log exchange time, bytes on the wire, compression factor under ``mpi/compressed/``.
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
        log_stats: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
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
        )
        super().__init__(
            rule=rule,
            log_stats=log_stats,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
