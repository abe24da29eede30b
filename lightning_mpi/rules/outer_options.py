"""The options DiLoCo and Streaming DiLoCo share: the period, the outer step and how Δ travels.

Why each default is what it is (the paper's outer rate and momentum, our shorter period, the
warm-up step) is told with the algorithm, in :mod:`lightning_mpi.rules.diloco`'s docstring;
the ``doc=`` of each option is what the strategy reference (docs/strategies.md) prints.
:class:`OuterOptions` is a base class of :class:`~.diloco.DiLoCoRule` and
:class:`~.streaming_diloco.StreamingDiLoCoRule`, and is importable from :mod:`.diloco` as before.
"""

from __future__ import annotations

import math
from typing import Literal

from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.outer_period import check_period


@options_class
class OuterOptions(Rule):
    """The options DiLoCo and Streaming DiLoCo share: the outer step and how Δ travels."""

    period: int | Literal["auto"] = option(
        default=50,
        doc="H, inner steps between outer steps (≥ 1); the paper's 500 is made for runs of tens of thousands of steps. "
        '`"auto"`: the smallest period whose exchange, after the wire format, hides behind that many steps, from '
        "the compute time of a step and the link measured in the first steps (agreed by every rank; saved in "
        "checkpoints).",
        check=check_period,
    )
    outer_lr: float = option(
        default=0.7,
        doc="outer learning rate (> 0); the paper's 0.7.",
        check=number(0.0, math.inf, low_open=True, high_open=True),
    )
    outer_momentum: float = option(
        default=0.9,
        doc="outer Nesterov momentum in [0, 1); 0 is plain SGD, and `outer_lr=1, outer_momentum=0` is periodic "
        "model averaging.",
        check=number(0.0, 1.0, high_open=True),
    )
    wire: Literal["fp32", "bf16", "int8", "int4"] = option(
        default="fp32",
        doc='how Δ travels: `"fp32"` (one Allreduce), `"bf16"`, `"int8"` or `"int4"` (ASA with error feedback).',
    )
    outer_warmup: int = option(
        default=1,
        doc="the first outer steps of each fragment that average the replicas (θ_global ← mean θᵢ: outer lr 1, "
        "no momentum) before the Nesterov steps start; keeps a short run's first outer steps from overshooting.",
        check=integer(0),
    )
