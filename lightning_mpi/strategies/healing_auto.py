"""``mpi_auto`` through a heal (:mod:`.healing_rules` dispatches here): its arm's exchanges heal as
that arm's do (the operations of :mod:`.healing_rules` act on the arm), and its decision is one
healing operation (:func:`auto_decision`). What the survivors agree on the healed run, and why,
is in :mod:`lightning_mpi.rules.auto.heal`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_mpi.rules.auto import BoundAuto
from lightning_mpi.rules.auto.arms import optimizer_float_state
from lightning_mpi.rules.auto.choice import Choice
from lightning_mpi.rules.base import BoundRule
from lightning_mpi.rules.diloco import BoundDiLoCo
from lightning_mpi.strategies.healing_rules import heal_after_step, heal_grads, heal_outer_end
from lightning_mpi.strategies.healing_state import kept_state


class _ArmRunner:
    """The arm ``mpi_auto`` runs, as the rule the operations of :mod:`.healing_rules` act on (read afresh: a
    heal binds a new ``BoundAuto``)."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    @property
    def bound(self) -> BoundRule:
        inner: BoundRule = self._runner.bound.inner
        return inner


def auto_kept_state(bound: BoundAuto) -> dict[str, Any]:
    """``mpi_auto``'s kept state: its decisions' state, and its arm's kept state (``"inner"``, this
    rank's own part of it under ``"local"``, which a replacement does not take); inside a decision,
    the state that decision started from (``"deciding"``). Loaded, it makes the survivors agree
    (:meth:`~lightning_mpi.rules.auto.BoundAuto.load_state_dict`)."""
    if bound.deciding is not None:
        return bound.deciding
    inner = dict(kept_state(bound.inner) or {})
    local = inner.pop("local", None)
    state = {**bound.counters(), "healed": True, "deciding": False, "inner": inner}
    if local is not None:
        state["local"] = local
    return state


def auto_grads(healing: Any, runner: Any, optimizer: Any, module: torch.nn.Module) -> bool:
    """``mpi_auto``'s ``before_step``: its arm's as a healing operation (:func:`heal_grads`), then,
    where a rejected local step was counted here and a decision is due, the decision."""
    runner.bound.heal_snapshots = True  # every arm it binds keeps what its exchanges start from
    runner.bound.begin_exchange()
    accepted = heal_grads(healing, _ArmRunner(runner), optimizer, module)
    if runner.bound.end_exchange(accepted):
        auto_decision(healing, runner, optimizer)
    return accepted


def auto_after_step(healing: Any, runner: Any, optimizer: Any) -> None:
    """``mpi_auto``'s ``after_step``: its arm's (:func:`heal_after_step`), then the decision where due."""
    runner.bound.heal_snapshots = True
    start = time.perf_counter()
    heal_after_step(healing, _ArmRunner(runner), optimizer)
    if runner.bound.end_step(time.perf_counter() - start):
        auto_decision(healing, runner, optimizer)
    runner.bound.clock.resume()


def auto_train_end(healing: Any, runner: Any) -> None:
    """``mpi_auto``'s ``on_train_end``: where its arm is Streaming DiLoCo, that arm's final average
    as a healing operation (:func:`heal_outer_end`: redone over the survivors, who end bitwise
    identical on the mean of their own replicas); the every-step arms exchange nothing there."""
    if isinstance(runner.bound.inner, BoundDiLoCo):
        heal_outer_end(healing, _ArmRunner(runner))
    else:
        runner.bound.on_train_end()


def _write_back(
    params: list[torch.Tensor],
    optimizer: Any,
    weights: list[torch.Tensor],
    float_state: dict[tuple[int, str], torch.Tensor],
) -> None:
    """Copy ``weights`` into ``params`` and ``float_state`` (keyed as
    :func:`~lightning_mpi.rules.auto.arms.optimizer_float_state` keys it) into the optimizer's
    state, where it holds that entry."""
    mine = optimizer_float_state(params, optimizer)
    with torch.no_grad():
        for p, value in zip(params, weights, strict=True):
            p.copy_(value)
        for key, value in float_state.items():
            if key in mine:
                mine[key].copy_(value)


def auto_decision(healing: Any, runner: Any, optimizer: Any) -> None:
    """``mpi_auto``'s decision (probe, dry runs, the agreement of their numbers, the switch) as one
    healing operation. Before it: its state, the weights and the optimizer's float state are kept
    (a heal inside it keeps that state, so the survivors bind the arm it started from). Redone
    over the survivors from them (not when one rank is left: nothing to decide there, it keeps
    the arm it started from until ranks join again); a survivor inside it when another completed it takes the
    other's outcome: the decisions' state and, where it switched, the new arm's state, the weights
    and the optimizer state the switch left (replicated: a switch averages them)."""
    auto = runner.bound
    params = list(auto.params)
    snapshot = {**auto_kept_state(auto), "deciding": True}
    weights = [p.detach().clone() for p in params]
    moments = {key: t.detach().clone() for key, t in optimizer_float_state(params, optimizer).items()}
    collective = [True]
    attempts = [0]

    def decide() -> None:
        bound = runner.bound
        attempts[0] += 1
        if attempts[0] > 1 and bound.transport.size == 1:
            collective[0] = False  # redone on the one rank left: nothing to measure or exchange
            return
        bound.deciding = snapshot  # what a heal keeps while this runs
        collective[0] = bound.decide(optimizer)
        bound.deciding = None

    def keep(_: None) -> tuple[dict[str, Any], Any, Any, Any]:
        bound = runner.bound
        if bound.choice == Choice.from_dict(snapshot["choice"]):
            return bound.counters(), None, None, None
        state = optimizer_float_state(params, optimizer)
        return (
            bound.counters(),
            kept_state(bound.inner),
            [p.detach().cpu().clone() for p in params],
            {key: t.detach().cpu().clone() for key, t in state.items()},
        )

    def take(kept: tuple[dict[str, Any], Any, Any, Any]) -> None:
        counters, inner, values, state = kept
        bound = runner.bound
        bound.take_decision(counters)
        if inner is None:
            return
        bound.inner.load_state_dict(inner)  # the arm the heal bound is the other's (rules.auto.heal)
        _write_back(params, optimizer, values, state)
        replicas = getattr(bound.inner, "replicas", None)
        if replicas is not None:
            replicas.remember(optimizer)

    def put_back() -> None:
        _write_back(params, optimizer, weights, moments)

    healing.operation("the mpi_auto decision", decide, keep, take, put_back, counted=lambda: collective[0])
