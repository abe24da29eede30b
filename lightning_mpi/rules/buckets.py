"""The bucket options that the every-step gradient-averaging rules share.

Gradients travel in buckets of whole tensors, in reverse model order (the last layers' gradients
are ready first in backward). :class:`Buckets` holds the options of that bucketing, so that
:class:`~lightning_mpi.rules.sync.SyncRule`, :class:`~lightning_mpi.rules.compressed.CompressedSyncRule`
and :class:`~lightning_mpi.rules.powersgd.PowerSGDRule` define them once.
"""

from __future__ import annotations

import math

from lightning_mpi.options import number, option, options_class
from lightning_mpi.rules.base import Rule

_POSITIVE = number(0, math.inf, low_open=True, high_open=True)


@options_class
class Buckets(Rule):
    """Options of the bucketed exchange (a base of the every-step rules, not a rule of its own)."""

    bucket_mb: float = option(
        default=25.0,
        doc="exchange bucket size in MiB (> 0); a bucket closes once it holds this much, so it ends on a "
        "whole tensor: smaller buckets start exchanging earlier in backward, larger ones pay less latency.",
        check=_POSITIVE,
    )
    first_bucket_mb: float = option(
        default=1.0,
        doc="size of the first bucket (the last layers' gradients) in MiB (> 0; at most `bucket_mb`): small, as "
        "in DDP, so that the link gets busy after the last layer or two of backward.",
        check=_POSITIVE,
    )
    overlap: bool = option(
        default=True,
        doc="start each bucket's exchange from the gradient hooks as soon as its gradients are ready, so it "
        "runs behind the rest of backward.",
    )

    def bucket_bytes(self) -> int:
        """:attr:`bucket_mb` in bytes (at least 1)."""
        return max(1, int(self.bucket_mb * 2**20))

    def first_bucket_bytes(self) -> int:
        """:attr:`first_bucket_mb` in bytes, at most :meth:`bucket_bytes` (at least 1)."""
        return max(1, int(min(self.first_bucket_mb, self.bucket_mb) * 2**20))


@options_class
class SegmentedBuckets(Buckets):
    """Bucket options of the ASA-based rules, whose buckets travel as a pipeline of segments."""

    segment_mb: float = option(
        default=4.0,
        doc="each bucket is exchanged as a pipeline of segments of this many MiB (> 0): one segment is cast and "
        "summed while the next is on the wire.",
        check=_POSITIVE,
    )
