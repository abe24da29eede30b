"""What each rule keeps through a heal, and the rule's hooks as healing operations
(:mod:`.healing`): which rules heal, how their state is carried to the survivors' binding, and
how an interrupted exchange is put back and redone.

=========================================  ================================================
rule (bound class)                          kept, and redone
=========================================  ================================================
synchronous, ``average="gradients"``        its counters; ``before_step`` redone with this
(:class:`~lightning_mpi.rules.sync.BoundSync`)  rank's own gradients put back
model averaging, EASGD                      ``state_dict()`` (counters; EASGD's replicated
                                            center); ``after_step`` redone with the state
                                            before it (weights change only once it completed)
any other                                   ``LookupError``: the strategy fails the run
=========================================  ================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_mpi.rules.averaging import BoundModelAveraging, averages_at
from lightning_mpi.rules.base import BoundRule
from lightning_mpi.rules.easgd import BoundEASGD
from lightning_mpi.rules.sync import BoundSync

#: Rules whose ranks step on their own gradients and exchange in ``after_step`` every ``period``
#: steps, with a state that each rank holds whole (``state_dict`` makes no collective): whether
#: an ``after_step`` exchanged, from the state before it and the rule after it.
_LOCAL_STEP_RULES: dict[type, Callable[[Any, dict[str, Any]], bool]] = {
    BoundModelAveraging: lambda bound, before: bound.averages != before["averages"],
    BoundEASGD: lambda bound, before: (
        bound.transport.size > 1 and bound.steps != before["steps"] and bound.steps % bound.rule.period == 0
    ),
}


def kept_state(bound: BoundRule | None) -> dict[str, Any] | None:
    """What the bound rule carries into the healed run (its state, read locally: the other ranks
    are not reachable any more), ``None`` when no rule is live (nothing to bind again); raises
    ``LookupError`` naming why for a rule that cannot heal yet."""
    if bound is None:
        return None
    if type(bound) is BoundSync:
        if bound.rule.average != "gradients":
            raise LookupError(f'average={bound.rule.average!r}: only average="gradients" heals so far')
        return {"skipped_steps": bound.skipped_steps}
    if type(bound) in _LOCAL_STEP_RULES:
        # model averaging: its counters; EASGD: its counter and the center (replicated: every
        # survivor holds it whole); the weights are the module's
        return bound.state_dict()
    raise LookupError(f"{type(bound).__name__} keeps state that is not rebuilt after a heal yet")


def heal_grads(healing: Any, runner: Any, optimizer: Any, module: torch.nn.Module) -> bool:
    """The rule's exchange (``before_step``) as a healing operation: this rank's own gradients are
    kept before it, put back before a redo (an interrupted exchange may have averaged some
    buckets already), and the exchanged gradients are what a survivor that missed the exchange's
    completion takes (one copy of the gradients each, every step, while ``heal`` is set)."""
    params = [p for p in module.parameters() if p.requires_grad]
    own = [None if p.grad is None else p.grad.detach().clone() for p in params]

    bound = runner.bound
    # the synchronous rules exchange here every step; of the local-step rules only model averaging
    # does, in its warm-up (gradients averaged)
    if isinstance(bound, BoundModelAveraging):
        exchanges = bound.transport.size > 1 and (
            averages_at(bound.steps + 1, bound.rule.period, bound.rule.sync_warmup_steps) == "gradients"
        )
    else:
        exchanges = type(bound) not in _LOCAL_STEP_RULES

    def exchange() -> bool:
        bound = runner.bound
        assert bound is not None
        return bool(bound.before_step(optimizer))

    def put_back() -> None:
        for p, grad in zip(params, own, strict=True):
            p.grad = None if grad is None else grad.clone()

    def keep(accepted: bool) -> tuple[bool, list[torch.Tensor | None]]:
        return accepted, [None if p.grad is None else p.grad.detach().cpu().clone() for p in params]

    def take(kept: tuple[bool, list[torch.Tensor | None]]) -> bool:
        accepted, grads = kept
        for p, grad in zip(params, grads, strict=True):
            p.grad = None if grad is None else grad.to(p.device)
        return accepted

    return healing.operation("the exchange", exchange, keep, take, put_back, counted=lambda: exchanges)


def heal_after_step(healing: Any, runner: Any, optimizer: Any) -> None:
    """The rule's ``after_step`` as a healing operation where it may exchange (model averaging's
    weight average, EASGD's elastic exchange, every ``period`` steps): its state is put back
    before a redo (the exchange changes weights and center only once it completed), and a
    survivor that missed the exchange's completion takes the weights and state of one that has."""
    bound = runner.bound
    assert bound is not None
    exchanged = _LOCAL_STEP_RULES.get(type(bound))
    if not healing.active or exchanged is None:
        bound.after_step(optimizer)  # the synchronous rules exchange nothing here (average="gradients")
        return
    before = bound.state_dict()
    params = bound.params

    def average() -> None:
        runner.bound.after_step(optimizer)

    def keep(_: None) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return runner.bound.state_dict(), [p.detach().cpu().clone() for p in params]

    def take(kept: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
        state, weights = kept
        runner.bound.load_state_dict(state)
        with torch.no_grad():
            for p, w in zip(params, weights, strict=True):
                p.copy_(w)

    def put_back() -> None:
        runner.bound.load_state_dict(before)

    healing.operation(
        "the weight average",
        average,
        keep,
        take,
        put_back,
        counted=lambda: exchanged(runner.bound, before),
    )
