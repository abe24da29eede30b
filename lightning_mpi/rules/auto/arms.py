"""``mpi_auto``'s arms (:mod:`.rule`): the rule each choice trains with, bound as the rule binds it,
and the optimizer state that a switch away from a local-step arm averages.

The arms are the existing rules, held by composition; which arm to train with is
:mod:`.choice`'s, when to switch and the order of a switch's steps :class:`~.rule.BoundAuto`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.comm.transport import Transport
from lightning_mpi.rules.auto.choice import Choice
from lightning_mpi.rules.base import BoundRule, Rule
from lightning_mpi.rules.diloco.rule import DiLoCoRule
from lightning_mpi.rules.diloco.streaming import StreamingDiLoCoRule
from lightning_mpi.rules.hybrid import HybridRule
from lightning_mpi.rules.powersgd.rule import PowerSGDRule
from lightning_mpi.rules.sync import SyncRule

#: The arms whose ranks (or hosts) step on their own between exchanges.
LOCAL_STEP_ARMS = ("probing", "streaming", "hybrid")
#: The wires Streaming DiLoCo takes (its ``wire`` option's type).
OuterWire = Literal["fp32", "bf16", "int8", "int4", "sparseloco"]


def arm_rule(choice: Choice) -> Rule:
    """The rule that trains ``choice``."""
    if choice.arm == "sync":
        return SyncRule(exchange="asa", wire="bf16" if choice.wire == "bf16" else "fp16")
    if choice.arm == "powersgd":
        return PowerSGDRule()
    if choice.arm == "hybrid":  # replicas: the hosts (as Sizes found them for the choice)
        return HybridRule(
            period=choice.period,
            fragments=choice.fragments,
            overlap_steps=choice.overlap_steps,
            wire=cast(OuterWire, choice.wire),
        )
    if choice.arm == "streaming":
        return StreamingDiLoCoRule(
            period=choice.period,
            fragments=choice.fragments,
            overlap_steps=choice.overlap_steps,
            wire=cast(OuterWire, choice.wire),  # .choice picks among the allowed wires
        )
    # "probing", the first steps' arm of checkpoints written before the first steps ran Streaming
    # DiLoCo: local steps; the switch averages the weights once (outer lr 1, no momentum), 4-bit
    return DiLoCoRule(period=10**9, outer_lr=1.0, outer_momentum=0.0, wire="int4")


def bind_arm(choice: Choice, transport: Transport, params: Sequence[Tensor]) -> BoundRule:
    """``choice``'s rule bound to ``params`` (collective: a binding duplicates the communicator),
    quiet: an every-step arm does not warn that its exchange is slow, since ``mpi_auto`` measures
    that and switches (its own decisions say why)."""
    bound = arm_rule(choice).bind(transport, params)
    warning = getattr(bound, "exposed_warning", None)
    if warning is not None:
        warning.disarm()
    return bound


def optimizer_float_state(params: Sequence[Tensor], optimizer: Optimizer) -> dict[tuple[int, str], Tensor]:
    """The optimizer's per-parameter float state of ``params`` (momentum, Adam's moments: the
    entries shaped as their parameter), by parameter index and key: what a switch averages."""
    found: dict[tuple[int, str], Tensor] = {}
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, Tensor) and value.is_floating_point() and value.shape == param.shape:
                found[(index, str(key))] = value
    return found


def average_optimizer_state(transport: Transport, params: Sequence[Tensor], optimizer: Optimizer) -> None:
    """Average the optimizer's per-parameter float state of ``params`` over the ranks of
    ``transport`` (collective; it differed between them while each stepped on its own).

    The entries averaged are agreed first: a rank holds no state for a parameter it never
    stepped (its gradient was always None there, or its own steps were all rejected), so
    each rank's own entries could differ in number, and one Allreduce per entry would then
    not match between ranks. Entries that every rank holds are averaged, in one order on
    every rank; any other stays each rank's own."""
    size = transport.size
    if size == 1:
        return
    entries = optimizer_float_state(params, optimizer)
    held = transport.allgather_object(sorted(entries))
    everywhere = set(held[0]).intersection(*held[1:])
    for entry in sorted(everywhere):
        transport.allreduce_(entries[entry]).div_(size)
