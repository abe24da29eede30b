"""Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication: towards a
distributed free lunch", 2025, arXiv:2501.18512): DiLoCo whose exchange is cut into fragments,
overlapped with training and quantized.

The parameters are split into P fragments. Fragment p runs DiLoCo's outer loop on its own
(:mod:`lightning_mpi.rules.diloco.rule`), every H steps, staggered so that some fragment starts an
exchange every H/P steps::

    after inner step t, for the fragment p whose turn it is (t = o_p + kH):
        Δ_p ← (1/W) Σᵢ (θ_global,p − θᵢ,p)              started now, non-blocking
    after inner step t + τ (τ more inner steps of the whole model meanwhile):
        θ_global,p ← OuterOpt(θ_global,p, Δ_p)
        θᵢ,p ← α·θᵢ,p + (1 − α)·θ_global,p            (mix the global fragment into the local one)

Peak traffic per exchange is one fragment's, about 1/P of DiLoCo's. Δ may travel as 4-bit
integers (``wire="int4"``), with error feedback.

Choices made here, and why:

- Fragments are contiguous runs of whole tensors in model order, cut where the running parameter
  count crosses multiples of total/P (:func:`split_fragments`). The paper strides transformer
  blocks over fragments (block b in fragment b mod P) so that each fragment spans the depth;
  a contiguous split needs no knowledge of the model's blocks and balances bytes for any model.
- Fragment p first exchanges after step ``o_p = floor((p + 1) H / P)`` (:func:`fragment_offsets`,
  torchft's schedule), so the last fragment exchanges at H, 2H, ... as DiLoCo does: with P = 1,
  τ = 0 and α = 0 this rule is DiLoCo, step for step.
- τ < floor(H/P), so at most one exchange is in flight (torchft requires the same); while it is,
  a progress thread makes MPI move it (MPICH moves data only inside MPI calls).
- A checkpoint completes an exchange in flight and saves its mean Δ, which the resumed run
  applies at the same step as the uninterrupted one.

Defaults, cited: the paper uses α = 0.5, τ of 1 to 5 inner steps and 4-bit outer gradients;
we take ``mix_alpha=0.5``, ``overlap_steps=1``, ``wire="int4"``, ``fragments=4`` (the paper's
models have 3 to 9 fragments), and DiLoCo's ``period=50``, outer_lr 0.7 and momentum 0.9.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

from torch import Tensor

from lightning_mpi.comm.transport import Transport
from lightning_mpi.options import integer, number, option, options_class, with_default
from lightning_mpi.rules.diloco.rule import BoundDiLoCo, OuterOptions


def split_fragments(sizes: Sequence[int], fragments: int) -> list[int]:
    """Assign tensors of the given sizes (model order) to ``fragments`` contiguous groups of about
    equal total size; returns each tensor's group. Every group gets at least one tensor.

    A tensor goes to the group its midpoint falls in (``floor(mid · P / total)``), pushed forward
    far enough to leave one tensor for each later group, and never skipping a group.

    Raises:
        ValueError: fewer tensors than ``fragments``.
    """
    count = len(sizes)
    if count < fragments:
        raise ValueError(
            f"fragments={fragments!r} is more than the model's {count} trainable tensors: a fragment holds whole "
            f"tensors, so pass fragments <= {count}"
        )
    total = max(1, sum(sizes))
    assignment: list[int] = []
    start = 0
    for index, size in enumerate(sizes):
        wanted = int((start + size / 2) * fragments // total)
        previous = assignment[-1] if assignment else 0
        lowest = fragments - (count - index)  # enough tensors left for the later groups
        group = 0 if index == 0 else min(previous + 1, max(previous, wanted, lowest))
        assignment.append(group)
        start += size
    return assignment


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """The step after which each fragment first exchanges: ``floor((p + 1) · H / P)``."""
    return [(p + 1) * period // fragments for p in range(fragments)]


def check_schedule(fragments: int, overlap_steps: int, period: int) -> None:
    """``fragments`` exchanged in turn every ``period`` steps, each overlapped with ``overlap_steps``:
    every fragment needs its own step in the period, and one exchange is in flight at a time."""
    if fragments > period:
        raise ValueError(
            f"fragments={fragments!r} is more than period={period!r}: each fragment needs "
            "its own step in the period; lower fragments or raise period"
        )
    if overlap_steps >= period // fragments:
        raise ValueError(
            f"overlap_steps={overlap_steps!r} is out of range: it must be < period // fragments = "
            f"{period // fragments} (one exchange in flight at a time); lower it, or raise period"
        )


@options_class
class StreamingDiLoCoRule(OuterOptions):
    """Streaming DiLoCo (Douillard et al. 2025): DiLoCo with the parameters cut into ``fragments``
    groups of whole tensors, each exchanged every ``period`` steps on a staggered schedule (one
    fragment every period/fragments steps), each exchange overlapped with ``overlap_steps`` inner
    steps and mixed into the local weights with ``mix_alpha``. Peak bytes per exchange are about
    1/fragments of DiLoCo's. Registered as ``mpi_streaming_diloco``.
    """

    name = "streaming_diloco"

    fragments: int = option(
        default=4,
        doc="P, the number of fragments (≥ 1, ≤ period); a model with fewer trainable tensors runs with one "
        "fragment per tensor (and a warning).",
        check=integer(1),
    )
    overlap_steps: int = option(
        default=1,
        doc="τ, inner steps between the start of a fragment's exchange and its use (0: blocking); below "
        'period // fragments. With `period="auto"`, raised where one fragment\'s exchange needs more steps to hide.',
        check=integer(0),
    )
    mix_alpha: float = option(
        default=0.5,
        doc="α in [0, 1): the arriving fragment sets θ_local ← α·θ_local + (1 − α)·θ_global (the paper's 0.5).",
        check=number(0.0, 1.0, high_open=True),
    )
    wire: Literal["fp32", "bf16", "int8", "int4", "sparseloco"] = with_default(OuterOptions, "wire", default="int4")

    def check_together(self) -> None:
        super().check_together()
        period = self.inner_period()
        if period != "auto":  # "auto" chooses a period ≥ fragments · (overlap_steps + 1)
            check_schedule(self.fragments, self.overlap_steps, period)

    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundDiLoCo:
        """Split ``params`` into fragments; a model with fewer trainable tensors than ``fragments``
        gets one fragment per tensor (with a warning), so that the default suits any model."""
        params = list(params)
        fragments = self.fragments
        if 0 < len(params) < fragments:
            warnings.warn(
                f"lightning_mpi: fragments={fragments} is more than the model's {len(params)} trainable tensors; "
                f"Streaming DiLoCo runs with {len(params)} fragments (one tensor each).",
                RuntimeWarning,
                stacklevel=2,
            )
            fragments = len(params)
        assignment = split_fragments([p.numel() for p in params], fragments) if params else []
        groups: list[list[Tensor]] = [[] for _ in range(fragments)]
        for param, group in zip(params, assignment, strict=True):
            groups[group].append(param)
        return BoundDiLoCo(
            self,
            transport,
            params,
            groups,
            lambda period: fragment_offsets(period, fragments),
            overlap_steps=self.overlap_steps,
            mix_alpha=self.mix_alpha,
        )
